"""Offline throughput of the engine: 64 requests, 128-token prompts from a seeded RNG, 64 greedy output
tokens each with ignore_eos; prints output tokens/s per run and the median, for each checkpoint.

    python benchmarks/bench_throughput.py                   # tiny and 100m, 3 timed runs each
    python benchmarks/bench_throughput.py --models tiny --runs 5
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402

NUM_REQUESTS = 64
PROMPT_LEN = 128
OUTPUT_LEN = 64


def make_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]


def run_once(engine: LLMEngine, seed: int) -> float:
    """Output tokens/s of one workload; prompts differ per run so no prefix-cache hit helps."""
    prompts = make_prompts(engine.model_config.vocab_size, seed)
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    if num_tokens != NUM_REQUESTS * OUTPUT_LEN:
        raise RuntimeError(f"expected {NUM_REQUESTS * OUTPUT_LEN} output tokens, got {num_tokens}")
    return num_tokens / elapsed


def offline_engine(model: str, dtype: str, threads: int | None = None, *, max_num_batched_tokens: int = 8192,
                   block_size: int = 16, seed: int = 0, device: str = "cpu") -> LLMEngine:
    """The engine this workload runs on: room for every request at once (one prefill step of all the
    prompts at the default token budget, then one decode step per output token)."""
    blocks_per_request = -(-(PROMPT_LEN + OUTPUT_LEN) // block_size)
    return LLMEngine(
        model,
        SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=PROMPT_LEN + OUTPUT_LEN + 16),
        CacheConfig(block_size=block_size, num_blocks=NUM_REQUESTS * blocks_per_request + 64),
        dtype=dtype, seed=seed, device=device, num_threads=threads,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], help="built-in presets or HF dirs")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per model (median printed)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; workload: "
          f"{NUM_REQUESTS} requests x {PROMPT_LEN} prompt tokens -> {OUTPUT_LEN} output tokens, greedy, ignore_eos")
    for model in args.models:
        engine = offline_engine(model, args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                                block_size=args.block_size, seed=args.seed, device=args.device)
        run_once(engine, seed=10_000)  # warm-up: allocator, thread pool, kernel selection
        results = []
        for run in range(args.runs):
            tokens_per_s = run_once(engine, seed=args.seed + run)
            results.append(tokens_per_s)
            # The 1-minute load average shows whether other processes competed for the cores.
            print(f"  {model} run {run + 1}: {tokens_per_s:,.0f} output tokens/s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        print(f"{model} ({args.dtype}, {args.device}): median {statistics.median(results):,.0f} output tokens/s "
              f"over {len(results)} runs (min {min(results):,.0f}, max {max(results):,.0f})", flush=True)


if __name__ == "__main__":
    main()
