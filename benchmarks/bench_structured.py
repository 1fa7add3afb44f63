"""Decode throughput with and without a JSON-schema constraint (llguidance masks on the CPU).

Both workloads run the same requests (short random prompts, OUTPUT_LEN greedy tokens each). The schema
ends in a string of at least MIN_TEXT_CHARS characters, so every constrained request also produces exactly
OUTPUT_LEN tokens and both runs do the same model work; the difference is the grammar's cost (mask,
advance, masked sampling). Prints output tokens per second per run, the medians and the overhead.
Time is this process's CPU time by default (one torch thread): on a shared machine wall-clock time
mostly measures the neighbours; --clock wall measures wall-clock time instead.

    python benchmarks/bench_structured.py                    # tiny, 32 requests, 3 runs
    python benchmarks/bench_structured.py --model 100m --runs 5

The tokenizer is the byte-level BPE the tests train (tests/bpe_tokenizer.py), or --tokenizer FILE.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.request import SamplingParams, StructuredOutputSpec  # noqa: E402
from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402

PROMPT_LEN = 32
OUTPUT_LEN = 64
MIN_TEXT_CHARS = 4 * OUTPUT_LEN * 8  # more characters than OUTPUT_LEN tokens can hold
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "text": {"type": "string", "minLength": MIN_TEXT_CHARS},
    },
    "required": ["name", "ok", "tags", "text"],
    "additionalProperties": False,
}


def load_tokenizer(path: str | None):
    if path is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)
    from bpe_tokenizer import bpe_tokenizer

    return bpe_tokenizer()


def run_once(engine: LLMEngine, num_requests: int, params: SamplingParams, seed: int, clock=time.process_time) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, engine.model_config.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(num_requests)]
    start = clock()
    outputs = engine.generate(prompts, params)
    elapsed = clock() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    if num_tokens != num_requests * OUTPUT_LEN:
        raise RuntimeError(f"expected {num_requests * OUTPUT_LEN} output tokens, got {num_tokens}")
    return num_tokens / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="built-in preset (its vocab must fit the tokenizer)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the tests' BPE)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--max-overhead", type=float, default=0.15, help="fail when the constraint costs more")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    engine = LLMEngine(args.model, SchedulerConfig(max_model_len=1024, max_num_seqs=args.num_requests),
                       CacheConfig(block_size=16, num_blocks=args.num_requests * 8 + 16))
    engine.tokenizer = load_tokenizer(args.tokenizer)
    free = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    constrained = SamplingParams(max_tokens=OUTPUT_LEN, structured_output=StructuredOutputSpec(json_schema=json.dumps(SCHEMA)))
    run_once(engine, 4, free, seed=999)  # warm-up: kernels, allocator, the grammar compiler
    run_once(engine, 4, constrained, seed=998)
    results = {"free": [], "json_schema": []}
    for run in range(args.runs):  # interleaved, so machine noise hits both alike
        results["free"].append(run_once(engine, args.num_requests, free, run, clock))
        results["json_schema"].append(run_once(engine, args.num_requests, constrained, run, clock))
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"{name:12s} output tok/s: " + ", ".join(f"{v:.0f}" for v in values) + f"  (median {medians[name]:.0f})")
    overhead = 1 - medians["json_schema"] / medians["free"]
    print(f"model {args.model}, {args.num_requests} requests x {OUTPUT_LEN} tokens, {args.threads} thread(s), "
          f"{args.clock} clock: "
          f"JSON-schema constraint costs {overhead:.1%} of decode throughput (limit {args.max_overhead:.0%})")
    return 0 if overhead <= args.max_overhead else 1


if __name__ == "__main__":
    sys.exit(main())
