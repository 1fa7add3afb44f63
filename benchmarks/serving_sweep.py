"""Serving sweep: starts the split system (router + prefill + decode) and the colocated server on
127.0.0.1, runs the reference workload at several request rates against each, and writes JSON, plots
and a markdown table. Every process it starts is stopped by pid at the end.

Run from the repo root:
    python benchmarks/serving_sweep.py [--systems colocated,split] [--rates 4,8,12,inf] [--out-dir out/serving_sweep]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.bench import (  # noqa: E402
    add_workload_flags, format_summary, parse_rate, run_benchmark, slo_from_args, workload_from_args, write_report,
)
from pdserve.bench_stats import markdown_table  # noqa: E402
from pdserve.launcher import HOST, LocalCluster, free_port, start_service, wait_serving  # noqa: E402

SYSTEMS = ("colocated", "split")
DEFAULT_ENV: list[str] = []
DEFAULT_TTFT_SLO_MS = 100.0
DEFAULT_TPOT_SLO_MS = 20.0
# vLLM 0.32 on the reference machine, same workload (seed 0, 128 requests, 128/64 tokens, r=0.5).
VLLM_REFERENCE = """\
| vLLM 0.32 reference | rate 4: TTFT p50 / TPOT p50 (ms) | rate 8: TTFT p50 / TPOT p50 (ms) | all at once: out tok/s |
|---|---|---|---|
| colocated | 27-45 / 8-11 | 39 / 13 | 1182 |
| split (NIXL) | 262 / 34 | 495 / 89 | 583 |
"""


class Colocated:
    """The colocated server as one process, shaped like LocalCluster for the sweep."""

    def __init__(self, service):
        self.service = service
        self.services = [service]

    @classmethod
    def start(cls, pod_args, log_dir: Path, env: dict[str, str], timeout_s: float) -> "Colocated":
        port = free_port()
        service = start_service("colocated", "colocated_svc", ["--host", HOST, "--port", str(port), *pod_args],
                                address=f"{HOST}:{port}", log_dir=log_dir, env=env)
        try:
            wait_serving(service, timeout_s)
        except BaseException:
            service.stop()
            raise
        return cls(service)

    @property
    def address(self) -> str:
        return self.service.address

    def stop(self) -> None:
        self.service.stop()


def _num_threads(system: str) -> int:
    """Torch threads per pod: the colocated pod gets every core, the two split pods half each (the
    router and the client need the rest; oversubscribed torch threads slow everything down)."""
    cores = os.cpu_count() or 2
    return cores if system == "colocated" else max(1, cores // 2)


def start_system(system: str, args: argparse.Namespace, log_dir: Path):
    pod_args = ["--model", args.model, *shlex.split(args.pod_args)]
    if "--num-threads" not in pod_args:
        pod_args += ["--num-threads", str(_num_threads(system))]
    env = dict(kv.split("=", 1) for kv in args.env)
    if system == "colocated":
        return Colocated.start(pod_args, log_dir, env, args.start_timeout_s)
    cluster = LocalCluster.start(pod_args=pod_args, router_args=shlex.split(args.router_args), log_dir=log_dir,
                                 env=env, timeout_s=args.start_timeout_s)
    cluster.address = cluster.router.address
    return cluster


def sweep_system(system: str, args: argparse.Namespace, rates: list[float]) -> list[dict]:
    log_dir = args.out_dir / "logs" / system
    print(f"== {system}: starting (logs in {log_dir})", flush=True)
    running = start_system(system, args, log_dir)
    reports = []
    try:
        print("   " + ", ".join(f"{s.name} {s.address} pid {s.pid}" for s in running.services), flush=True)
        for rate in rates:
            config = workload_from_args(args, rate)
            label = f"{system}-rate{config.to_json()['rate']}"
            report = asyncio.run(run_benchmark(
                running.address, config, slo=slo_from_args(args), label=label,
                request_timeout_s=args.request_timeout_s, num_warmups=args.num_warmups,
            ))
            report["system"] = system
            write_report(report, args.out_dir, plots=not args.no_plots)
            print(format_summary(report), flush=True)
            reports.append(report)
            dead = [s.name for s in running.services if not s.is_running()]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during the {label} run; see {log_dir}")
    finally:
        running.stop()
    return reports


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_outputs(sweeps: dict[str, list[dict]], args: argparse.Namespace, command: str) -> None:
    out = args.out_dir
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "commit": git_commit(), "service_env": args.env, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    summary = {system: [{k: v for k, v in r.items() if k != "requests"} for r in reports]
               for system, reports in sweeps.items()}
    (out / "sweep.json").write_text(json.dumps({"command": command, "machine": machine, "runs": summary},
                                               indent=1, allow_nan=False))
    all_reports = [r for reports in sweeps.values() for r in reports]
    table = markdown_table(all_reports)
    slo = f"goodput counts requests with TTFT <= {args.ttft_slo_ms} ms and TPOT <= {args.tpot_slo_ms} ms"
    loads = ", ".join(f"{r['label']} {r['load_average_before'][0]:.1f}" for r in all_reports)
    (out / "summary.md").write_text(
        f"# Serving sweep\n\n`{command}`\n\nMachine: {machine}\n\n{table}\n{slo}; "
        f"1-minute load average before each run: {loads}\n\n{VLLM_REFERENCE}"
    )
    if not args.no_plots:
        from pdserve.bench_plot import plot_latency_cdfs, plot_sweep

        plot_sweep(sweeps, out / "sweep.png", title="pdserve serving sweep (tiny model)")
        for system, reports in sweeps.items():
            plot_latency_cdfs(reports, out / f"{system}_latency_cdf.png", title=f"{system}: latency CDFs by rate")
    print("\n" + table + "\n" + slo + "\n\n" + VLLM_REFERENCE, flush=True)
    print(f"wrote {out}/sweep.json, summary.md" + ("" if args.no_plots else ", sweep.png, *_latency_cdf.png"))


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma separated: colocated, split")
    parser.add_argument("--rates", default="4,8,12,inf", help="comma separated request rates ('inf' = all at once)")
    add_workload_flags(parser)
    parser.add_argument("--model", default="tiny", help="built-in preset or HF model directory")
    parser.add_argument("--pod-args", default="", help="extra flags for every pod, e.g. '--max-num-seqs 64'")
    parser.add_argument("--router-args", default="", help="extra flags for the router")
    parser.add_argument("--env", action="append", default=None, metavar="KEY=VALUE",
                        help="environment for the services (repeatable)")
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--out-dir", type=Path, default=Path("out/serving_sweep"))
    # A stuck system shows up as failures, not a hang; goodput is judged against these SLOs by default.
    parser.set_defaults(request_timeout_s=120.0, ttft_slo_ms=DEFAULT_TTFT_SLO_MS, tpot_slo_ms=DEFAULT_TPOT_SLO_MS)
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}; got {args.systems!r}")
    try:
        rates = [parse_rate(r.strip()) for r in args.rates.split(",") if r.strip()]
        workload_from_args(args, rates[0] if rates else math.inf)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    args.env = DEFAULT_ENV if args.env is None else args.env
    bad_env = [kv for kv in args.env if "=" not in kv]
    if bad_env:
        parser.error(f"--env takes KEY=VALUE, got {bad_env}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the services started here are stopped on the way out.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    command = "python benchmarks/serving_sweep.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    sweeps = {system: sweep_system(system, args, rates) for system in systems}
    write_outputs(sweeps, args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
