"""Host time of one ModelRunner step: what a GPU step pays on the CPU before and after its kernels (inputs,
block tables, slot mapping, sampling bookkeeping), which CUDA graphs cannot hide.

The network's forward pass and logits are replaced by ready-made tensors of the right shapes, so what is
timed is only the runner's own work around them, on the CPU. Same cases as bench_gpu_step.py: decode at
batch 1, 32 and 128 (contexts of 1,024 tokens) and one 2,048-token prefill, greedy.

    python benchmarks/bench_runner_host.py              # median and p10 per step, in microseconds
    python benchmarks/bench_runner_host.py --repo /tmp/old-checkout   # the same, for another tree

On an H200 the step budget left above a plain CUDA-graph forward is 0.43 ms at batch 1 and 0.74 ms at
batch 128 (issue 15's targets against its references).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

_LOGIT_COLUMNS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose runner is timed (default: this one)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per case")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(args.repo))
    sys.path.insert(0, str(args.repo / "benchmarks"))
    torch.set_num_threads(1)
    import bench_gpu_step as cases  # noqa: E402  (from --repo)
    from shared.engine.model.loader import load_model  # noqa: E402
    from shared.engine.model.runner import ModelRunner  # noqa: E402

    device = torch.device("cpu")
    loaded = load_model("tiny", dtype="auto", seed=0, device=device)
    max_batch = 128
    num_blocks = max_batch * -(-(args.context + args.steps + 20) // 16) + 8
    max_model_len = loaded.config.max_position_embeddings
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=16, max_model_len=max_model_len,
                         device=device, cuda_graphs=False)
    hidden_size = loaded.config.hidden_size
    # The network, out of the timing: rows of zeros for hidden states and logits. The logits have a few
    # columns only: the sampler's reductions over the vocabulary are kernels on a GPU, not host time.
    runner.model.forward = lambda ids, positions, kv, meta, rows=None: torch.zeros(ids.shape[0], hidden_size)
    runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], _LOGIT_COLUMNS)
    timer = cases.Timer(device)
    print(f"runner host time per step, {args.repo} (network replaced by zeros; {args.steps} steps a case)")
    for batch in (1, 32, 128):
        times = cases.decode_case(runner, timer, batch, [args.context] * batch, graphs=False, warmups=20,
                                  repeats=args.steps, tag=f"b{batch}")
        _report(f"decode batch {batch:3}", times)
    times = cases.prefill_case(runner, timer, args.prefill_tokens, warmups=3, repeats=max(10, args.steps // 10))
    _report(f"prefill {args.prefill_tokens} tokens", times)
    return 0


def _report(label: str, times_ms: list[float]) -> None:
    ordered = sorted(times_ms)
    p10 = ordered[len(ordered) // 10]
    print(f"{label:22} median {statistics.median(times_ms) * 1e3:8.1f} us   p10 {p10 * 1e3:8.1f} us")


if __name__ == "__main__":
    sys.exit(main())
