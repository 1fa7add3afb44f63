"""Time of sampler.sample() for random rows: batch x vocabulary x filter, on the CPU (one thread).

Logits are Gaussian with a scale: 4 gives a peaked row (a top-p 0.9 nucleus of a few dozen tokens, as a
language model's usually is), 1 a flat one (a nucleus of most of the vocabulary: the slow case).

    python benchmarks/bench_sampler.py                      # median ms per call
    python benchmarks/bench_sampler.py --repo /tmp/old      # the same, for another checkout
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

FILTERS = {
    "temperature 0.8": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from shared.engine.model.sampler import sample  # noqa: E402  (from --repo)
    from shared.engine.request import SamplingParams  # noqa: E402

    torch.set_num_threads(1)
    print(f"sampler.sample, random rows, {args.repo}; median of {args.repeats} calls (ms)")
    print(f"{'vocab':>7} {'batch':>5} {'logits':>7}  " + "  ".join(f"{name:>15}" for name in FILTERS))
    for vocab in (32000, 128256):
        for batch in (1, 32, 128):
            for scale, shape in ((4.0, "peaked"), (1.0, "flat")):
                logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * scale
                cells = []
                for options in FILTERS.values():
                    params = [SamplingParams(**options)] * batch
                    seeds, positions = list(range(batch)), [7] * batch
                    sample(logits, params, seeds, positions)  # warm-up
                    times = []
                    for _ in range(args.repeats):
                        started = time.perf_counter()
                        sample(logits, params, seeds, positions)
                        times.append((time.perf_counter() - started) * 1e3)
                    cells.append(f"{statistics.median(times):15.2f}")
                print(f"{vocab:>7} {batch:>5} {shape:>7}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
