"""What the OpenAI-compatible HTTP front costs: starts the split system (router with its HTTP port, prefill,
decode) on 127.0.0.1 and runs the reference workload (rate 8, 128 requests, 128/64 tokens, r=0.5) through
the gRPC Generate API and through HTTP (/v1/completions, streamed) in one run, alternating the two, each
run with its own seed so no run reuses another's prefix cache. Prints TTFT p50 and TPOT p50 of each
backend (over the pooled requests of its runs) and the HTTP overhead against the targets: TTFT p50 +10%
at most, TPOT p50 +0.3 ms at most. Every process it starts is stopped by pid at the end.

Run from the repo root:
    python benchmarks/bench_http_overhead.py [--rounds 2] [--rate 8] [--out-dir out/http_overhead]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.bench import add_workload_flags, format_summary, parse_rate, run_benchmark, workload_from_args  # noqa: E402
from pdserve.bench_stats import percentile  # noqa: E402
from pdserve.launcher import LocalCluster  # noqa: E402

MAX_TTFT_OVERHEAD = 0.10  # HTTP TTFT p50 may be at most 10% above gRPC's
MAX_TPOT_OVERHEAD_MS = 0.3  # and its TPOT p50 at most 0.3 ms above


def pooled_p50(reports: list[dict], key: str) -> float:
    values = [row[key] for report in reports for row in report["requests"] if row["error"] is None
              and row[key] is not None]
    return percentile(values, 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=parse_rate, default=8.0, help="requests per second")
    parser.add_argument("--rounds", type=int, default=2, help="gRPC + HTTP run pairs")
    add_workload_flags(parser)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out-dir", type=Path, default=Path("out/http_overhead"))
    parser.set_defaults(request_timeout_s=120.0)
    args = parser.parse_args(argv)
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    cluster = LocalCluster.start(pod_args=["--model", args.model, "--num-threads", threads],
                                 log_dir=args.out_dir / "logs", timeout_s=180.0)
    reports: dict[str, list[dict]] = {"grpc": [], "openai": []}
    try:
        targets = {"grpc": cluster.router.address, "openai": cluster.router.http_url}
        for round_index in range(args.rounds):
            for offset, backend in enumerate(("grpc", "openai")):
                seed = args.seed + 2 * round_index + offset
                config = dataclasses.replace(workload_from_args(args, args.rate), seed=seed)
                report = asyncio.run(run_benchmark(
                    targets[backend], config, label=f"{backend}-round{round_index}", backend=backend,
                    request_timeout_s=args.request_timeout_s, num_warmups=args.num_warmups, progress=False,
                ))
                print(format_summary(report), flush=True)
                reports[backend].append(report)
    finally:
        cluster.stop()
    figures = {backend: {"ttft_p50_ms": pooled_p50(runs, "ttft_ms"), "tpot_p50_ms": pooled_p50(runs, "tpot_ms"),
                         "num_failed": sum(r["num_failed"] for r in runs)} for backend, runs in reports.items()}
    grpc_f, http_f = figures["grpc"], figures["openai"]
    ttft_overhead = http_f["ttft_p50_ms"] / grpc_f["ttft_p50_ms"] - 1
    tpot_overhead_ms = http_f["tpot_p50_ms"] - grpc_f["tpot_p50_ms"]
    verdict = {"ttft_overhead": ttft_overhead, "tpot_overhead_ms": tpot_overhead_ms,
               "ttft_ok": ttft_overhead <= MAX_TTFT_OVERHEAD, "tpot_ok": tpot_overhead_ms <= MAX_TPOT_OVERHEAD_MS}
    command = "python benchmarks/bench_http_overhead.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "http_overhead.json").write_text(json.dumps(
        {"command": command, "figures": figures, "verdict": verdict, "load_average": os.getloadavg()}, indent=1))
    print("\n| backend | TTFT p50 (ms) | TPOT p50 (ms) | failed |\n|---|---|---|---|")
    for backend, f in figures.items():
        print(f"| {backend} | {f['ttft_p50_ms']:.2f} | {f['tpot_p50_ms']:.3f} | {f['num_failed']} |")
    print(f"HTTP overhead: TTFT p50 {100 * ttft_overhead:+.1f}% (target <= +{100 * MAX_TTFT_OVERHEAD:.0f}%: "
          f"{'ok' if verdict['ttft_ok'] else 'MISSED'}), TPOT p50 {tpot_overhead_ms:+.3f} ms "
          f"(target <= +{MAX_TPOT_OVERHEAD_MS} ms: {'ok' if verdict['tpot_ok'] else 'MISSED'})")
    return 0 if verdict["ttft_ok"] and verdict["tpot_ok"] and not any(f["num_failed"] for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
