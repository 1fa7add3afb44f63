"""TTFT and TPOT on the same prompts: the split system (router + prefill + decode processes on
127.0.0.1, KV over NIXL) against the single-process engine, one request at a time and all at once.

    python benchmarks/bench_split.py [--model tiny] [--num-prompts 16] [--prompt-len 256] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request, SamplingParams


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def _timings(started: float, token_times: list[float]) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from a request's start and the arrival time of each token."""
    ttft = token_times[0] - started
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else 0.0
    return ttft, tpot


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[float, float]]:
    """All prompts submitted at once to the in-process engine; per-token times taken at each step."""
    started = time.perf_counter()
    times: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        request_id = f"bench-{time.monotonic_ns()}-{i}"
        engine.add_request(Request(request_id, prompt, params, eos_token_id=engine.eos_token_id))
        times[request_id] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            times[output.request_id].extend([now] * len(output.new_token_ids))
    return [_timings(started, token_times) for token_times in times.values()]


def run_split(address: str, prompts: list[list[int]], params: SamplingParams) -> list[tuple[float, float]]:
    def one(prompt: list[int]) -> tuple[float, float]:
        token_times = []
        with PdserveClient(address) as client:
            started = time.perf_counter()
            for chunk in client.generate(prompt, max_tokens=params.max_tokens, ignore_eos=True, timeout=300):
                now = time.perf_counter()
                token_times.extend([now] * len(chunk.token_ids))
        return _timings(started, token_times)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _summary(label: str, timings: list[tuple[float, float]]) -> str:
    ttfts = [1000 * t for t, _ in timings]
    tpots = [1000 * t for _, t in timings]
    return (f"{label:34s} TTFT p50 {statistics.median(ttfts):8.1f} ms  mean {statistics.mean(ttfts):8.1f} ms   "
            f"TPOT p50 {statistics.median(tpots):6.2f} ms  mean {statistics.mean(tpots):6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine = LLMEngine(args.model, SchedulerConfig(max_model_len=2048), CacheConfig(num_blocks=4096))
    vocab = engine.model_config.vocab_size
    # Separate prompt sets per phase: a repeated prompt would be a prefix-cache hit, not a prefill.
    prompts = _prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    batch = _prompts(args.num_prompts, args.prompt_len, vocab, args.seed + 1)
    warmup = _prompts(2, args.prompt_len, vocab, args.seed + 2)
    print(f"model {args.model}: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} output tokens")

    run_engine(engine, warmup, params)
    single_one = [run_engine(engine, [prompt], params)[0] for prompt in prompts]
    single_all = run_engine(engine, batch, params)
    del engine

    with tempfile.TemporaryDirectory() as logs, LocalCluster.start(
        pod_args=["--model", args.model, "--num-blocks", "4096", "--num-threads", "1"], log_dir=Path(logs)
    ) as cluster:
        address = cluster.router.address
        run_split(address, warmup, params)
        split_one = [run_split(address, [prompt], params)[0] for prompt in prompts]
        split_all = run_split(address, batch, params)

    print(_summary("single-process, one at a time", single_one))
    print(_summary("split, one at a time", split_one))
    print(_summary(f"single-process, {args.num_prompts} at once", single_all))
    print(_summary(f"split, {args.num_prompts} at once", split_all))


if __name__ == "__main__":
    main()
