"""Model-runner step times on a GPU with the llama3-8b preset (bfloat16, random weights built on the GPU):
decode steps at batch 1, 32 and 128 with and without CUDA graphs, and a 2,048-token prefill.

    python benchmarks/bench_gpu_step.py --json /tmp/gpu_step.json          # CUDA, llama3-8b
    python benchmarks/bench_gpu_step.py --device cpu --preset tiny --quick  # a CPU smoke run

Each step is a whole ModelRunner.execute_model (inputs built from a SchedulerOutput, forward pass, logits,
greedy sampling, tokens back on the host), timed with CUDA events after warm-ups; the table shows the
median of the repeats. Decode requests start with their context already in the KV cache (as after a
prefill/decode handoff) and grow by one token a step. Targets for an H200 (issue 15): batch 1 <= 5.5 ms,
batch 32 (context ~1k) <= 6.5 ms, batch 128 (context 1,024) <= 10.5 ms, prefill 2,048 tokens <= 70 ms.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.model.loader import load_model  # noqa: E402
from shared.engine.model.runner import ModelRunner  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402
from shared.engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

BF16_PEAK_TFLOPS = 777.0  # H200 dense bfloat16 (the reference figure)
GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)


def scheduler_output(new: list[NewRequestData], cached: CachedRequestData, num_tokens: dict[str, int],
                     finished: set[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=num_tokens,
        total_num_scheduled_tokens=sum(num_tokens.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(finished),
    )


class Timer:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def decode_case(runner: ModelRunner, timer: Timer, batch: int, contexts: list[int], graphs: bool,
                warmups: int, repeats: int, tag: str) -> list[float]:
    """Median-ready step times of `batch` decoding requests whose contexts start at `contexts`."""
    bs = runner.block_size
    rng = random.Random(0)
    steps = warmups + repeats
    new, req_ids, next_block = [], [], 1  # block 0 is the null block
    for i, context in enumerate(contexts):
        num_blocks = -(-(context + steps) // bs)
        req_id = f"{tag}-{i}"
        prompt = [rng.randrange(runner.config.vocab_size) for _ in range(context)]
        new.append(NewRequestData(req_id=req_id, prompt_token_ids=prompt, prefill_token_ids=prompt,
                                  sampling_params=GREEDY, block_ids=list(range(next_block, next_block + num_blocks)),
                                  num_computed_tokens=context - 1))
        req_ids.append(req_id)
        next_block += num_blocks
    if next_block > runner.num_blocks:
        raise ValueError(f"the KV pool has {runner.num_blocks} blocks; this case needs {next_block}")
    saved_graphs = runner.decode_graphs
    runner.decode_graphs = saved_graphs if graphs else None
    times = []
    computed = [c - 1 for c in contexts]
    try:
        for step in range(steps):
            if step == 0:
                so = scheduler_output(new, CachedRequestData.make_empty(), {r: 1 for r in req_ids})
            else:
                cached = CachedRequestData(req_ids=list(req_ids), new_token_ids=[[] for _ in req_ids],
                                           new_block_ids=[None for _ in req_ids], num_computed_tokens=list(computed))
                so = scheduler_output([], cached, {r: 1 for r in req_ids})
            elapsed = timer(lambda: runner.execute_model(so))
            computed = [c + 1 for c in computed]
            if step >= warmups:
                times.append(elapsed)
    finally:
        runner.decode_graphs = saved_graphs
        runner.execute_model(scheduler_output([], CachedRequestData.make_empty(), {}, finished=set(req_ids)))
    return times


def prefill_case(runner: ModelRunner, timer: Timer, num_tokens: int, warmups: int, repeats: int) -> list[float]:
    rng = random.Random(1)
    blocks = list(range(1, 1 + -(-(num_tokens + 1) // runner.block_size)))
    times, previous = [], set()
    for step in range(warmups + repeats):
        req_id = f"prefill-{step}"
        prompt = [rng.randrange(runner.config.vocab_size) for _ in range(num_tokens)]
        new = NewRequestData(req_id=req_id, prompt_token_ids=prompt, prefill_token_ids=prompt,
                             sampling_params=GREEDY, block_ids=blocks, num_computed_tokens=0)
        so = scheduler_output([new], CachedRequestData.make_empty(), {req_id: num_tokens}, finished=previous)
        elapsed = timer(lambda: runner.execute_model(so))
        previous = {req_id}
        if step >= warmups:
            times.append(elapsed)
    runner.execute_model(scheduler_output([], CachedRequestData.make_empty(), {}, finished=previous))
    return times


def prefill_flops(config, num_tokens: int) -> float:
    """Matmul FLOPs of one prompt: the layers' projections, causal attention, and the one logit row."""
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    per_token_layer = 2 * (h * (q + 2 * kv) + q * h + h * 2 * i + i * h)
    causal_pairs = num_tokens * (num_tokens + 1) / 2
    attention_layer = 2 * 2 * config.num_heads * config.head_dim * causal_pairs  # QK^T and PV
    return config.num_layers * (num_tokens * per_token_layer + attention_layer) + 2 * h * config.vocab_size


def row_line(row: dict) -> str:
    extra = f"{row['tflops']:9.1f} ({100 * row['fraction_of_bf16_peak']:.0f}% of {BF16_PEAK_TFLOPS:.0f})" \
        if "tflops" in row else ""
    return (f"{row['case']:<24} {row['mean_context']:8.0f} {str(row['cuda_graphs']):>7} "
            f"{row['median_ms']:10.2f} {row['min_ms']:8.2f} {extra}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run: needs a small preset)")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmups", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="small batches and contexts (the CPU smoke run)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_step: no CUDA GPU here; use --device cpu --preset tiny --quick for a smoke run",
              file=sys.stderr)
        return 2
    if device.type == "cpu" and args.preset == "llama3-8b":
        print("bench_gpu_step: llama3-8b is for the GPU; on the CPU pass a small preset (--preset tiny)",
              file=sys.stderr)
        return 2
    if args.quick:
        decode_cases = [(1, [64]), (4, [48, 64, 80, 56]), (8, [64] * 8)]
        args.prefill_tokens = min(args.prefill_tokens, 128)
    else:
        rng = random.Random(args.seed)
        decode_cases = [(1, [1024]), (32, [rng.randrange(768, 1281) for _ in range(32)]), (128, [1024] * 128)]
    steps = args.warmups + args.repeats
    max_context = max(max(c) for _, c in decode_cases) + steps
    max_model_len = max(max_context, args.prefill_tokens + 1)
    pool_tokens = max(sum(c + steps + args.block_size for c in contexts) for _, contexts in decode_cases)
    num_blocks = max(pool_tokens, args.prefill_tokens + 2 * args.block_size) // args.block_size + 2

    started = time.perf_counter()
    loaded = load_model(args.preset, dtype="auto", seed=args.seed, device=device)
    loaded.model.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - started
    config = loaded.config
    started = time.perf_counter()
    # Graphs for just the measured batch sizes (a pod captures DEFAULT_BATCH_SIZES): the GPU check's limit.
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=args.block_size, max_model_len=max_model_len,
                         device=device, cuda_graphs=device.type == "cuda",
                         cuda_graph_batch_sizes=tuple(sorted({batch for batch, _ in decode_cases})))
    runner_s = time.perf_counter() - started
    timer = Timer(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{config.name} {config.dtype} on {device} ({device_name}); "
          f"built in {build_s:.1f} s; runner (KV pool, graph captures) {runner_s:.1f} s; attention: "
          f"{runner.attention_backend}; KV pool {num_blocks} blocks of {args.block_size}")

    result = {"preset": config.name, "dtype": config.dtype, "device": str(device), "device_name": device_name,
              "attention_backend": runner.attention_backend, "block_size": args.block_size, "build_s": build_s,
              "runner_s": runner_s, "warmups": args.warmups, "repeats": args.repeats, "rows": []}
    rows = result["rows"]

    def add_row(row: dict) -> None:
        """Keep the row, and rewrite --json with every row so far: a run cut short still leaves its figures."""
        rows.append(row)
        print(row_line(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))

    print(f"{'case':<24} {'context':>8} {'graphs':>7} {'median ms':>10} {'min ms':>8} {'TFLOP/s':>9}")
    for batch, contexts in decode_cases:
        for graphs in (False, True) if runner.decode_graphs is not None else (False,):
            times = decode_case(runner, timer, batch, contexts, graphs, args.warmups, args.repeats,
                                tag=f"b{batch}-{'g' if graphs else 'e'}")
            add_row({"case": f"decode batch {batch}", "batch": batch, "mean_context": statistics.mean(contexts),
                     "cuda_graphs": graphs, "median_ms": statistics.median(times), "min_ms": min(times)})
    times = prefill_case(runner, timer, args.prefill_tokens, min(args.warmups, 3), max(args.repeats // 2, 3))
    median = statistics.median(times)
    tflops = prefill_flops(config, args.prefill_tokens) / (median / 1e3) / 1e12
    add_row({"case": f"prefill {args.prefill_tokens} tokens", "batch": 1, "mean_context": args.prefill_tokens,
             "cuda_graphs": False, "median_ms": median, "min_ms": min(times), "tflops": tflops,
             "fraction_of_bf16_peak": tflops / BF16_PEAK_TFLOPS})

    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
