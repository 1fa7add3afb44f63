"""Measures a pod engine's service curves for the planner's simulation (benchmarks/bench_planner.py):
prefill time against prompt tokens, and decode step time against batch and context. Runs the engine
with the pods' own scheduler and cache settings, on one torch thread (one core per pod), and writes JSON.

    python benchmarks/measure_service_curves.py --model tiny --out benchmarks/data/service_curves_tiny.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.request import Request, SamplingParams  # noqa: E402
from shared.serving.pod.runtime import serving_cache_config, serving_scheduler_config  # noqa: E402

PROMPT_TOKENS = (32, 64, 128, 256, 512, 1024, 1536, 2000)
BATCHES = (1, 2, 4, 8, 16, 32, 48)
CONTEXTS = (128, 512, 1024, 1536, 2000)
DECODE_STEPS = 16


def prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def prefill_seconds(engine: LLMEngine, rng: random.Random, length: int, repeats: int) -> float:
    """Fastest of `repeats` times to the first token of one prompt alone (chunked as a pod would): on a
    shared machine the fastest run is the one least slowed by other processes."""
    vocab = engine.model_config.vocab_size
    times = []
    for _ in range(repeats):
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        started = time.perf_counter()
        engine.generate([prompt(rng, vocab, length)], params)
        times.append(time.perf_counter() - started)
    return min(times)


def decode_step_seconds(engine: LLMEngine, rng: random.Random, batch: int, context: int, index: int) -> float:
    """Fastest step of `batch` requests decoding at about `context` tokens each (the step least slowed by
    other processes on a shared machine)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, ignore_eos=True, temperature=0.0)
    ids = [f"d{index}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(Request(request_id, prompt(rng, vocab, context - 4), params, eos_token_id=engine.eos_token_id))
    while _prefilling(engine):
        engine.step()
    times = []
    for _ in range(DECODE_STEPS):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return min(times)


def _prefilling(engine: LLMEngine) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or bool(
        engine.scheduler.waiting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="built-in preset (tiny, 100m) or HF directory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a pod per core: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="prefill runs per prompt length (fastest kept)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scheduler, cache = serving_scheduler_config(), serving_cache_config()
    engine = LLMEngine(args.model, scheduler, cache, seed=0)
    rng = random.Random(0)
    prefill_seconds(engine, rng, 256, 1)  # warm-up
    prefill = [{"prompt_tokens": n, "seconds": prefill_seconds(engine, rng, n, args.repeats)} for n in PROMPT_TOKENS]
    for row in prefill:
        print(f"prefill {row['prompt_tokens']:5d} tokens: {row['seconds'] * 1000:8.1f} ms", flush=True)
    decode = []
    for batch in BATCHES:
        for context in CONTEXTS:
            if batch * (context // cache.block_size + 2) >= cache.num_blocks:
                continue
            seconds = decode_step_seconds(engine, rng, batch, context, len(decode))
            decode.append({"batch": batch, "context": context, "seconds": seconds})
            print(f"decode batch {batch:3d} context {context:5d}: {seconds * 1000:7.2f} ms/step", flush=True)
    args.out.write_text(json.dumps({
        "model": args.model, "threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average_at_end": round(os.getloadavg()[0], 2),
        "max_num_batched_tokens": scheduler.max_num_batched_tokens, "max_num_seqs": scheduler.max_num_seqs,
        "num_blocks": cache.num_blocks, "block_size": cache.block_size,
        "prefill": prefill, "decode": decode,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
