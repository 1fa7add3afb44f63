"""The planner scaling real local pods: `pdserve up --autoscale` (tiny preset) under a load whose
prompt:output shape shifts long-prompt/short-output -> short-prompt/long-output -> back. Prints per phase the
requests, lost requests, TTFT and ITL p90 and the pods in rotation, and when decode scaled; saves the
timeline (replicas per tier, TTFT p90 and ITL p90 over time) as a plot and JSON.

    nice -n 10 python benchmarks/bench_planner_local.py          # about 5 minutes; docs/bench/planner/local_*
    nice -n 10 python benchmarks/bench_planner_local.py --name local_lost --phases 512:16:80,64:384:100,512:16:100 \
        --decode-args="--num-blocks 96"                           # the second run's settings
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve.launcher import free_port  # noqa: E402
from planner_local_load import Phase, Record, run_load, sample_rotation  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WINDOW_S = 10.0  # the plot's latency p90s are over requests sent within each window


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="1024:16:80,64:512:100,1024:16:100",
                        help="prompt:output:seconds per phase, comma separated")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--jitter", type=float, default=0.25, help="lengths vary by this share either way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-target", type=float, default=1.0)
    parser.add_argument("--itl-target", type=float, default=0.03)
    parser.add_argument("--max-pods", type=int, default=4)
    parser.add_argument("--planner-args", default="--interval 5 --forecast-window 15 --horizon 10 --cooldown 20 "
                        "--capacity-window 60", help="the rest of the planner's policy flags, as one string")
    parser.add_argument("--pod-args", default="--max-num-seqs 32 --num-blocks 1024")
    # One decode pod's KV pool (160 blocks of 16 tokens) holds about 5 of the long-output phase's requests: on 2
    # shared cores a second decode pod adds memory (batch room), not CPU. The planner's decode capacity is KV-bound.
    parser.add_argument("--decode-args", default="--num-blocks 160")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "planner", help="where results go")
    parser.add_argument("--name", default="local", help="results: OUT/NAME_run.json and OUT/NAME_timeline.png")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from OUT/NAME_run.json")
    return parser.parse_args()


def start_up(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, list[str], str, str]:
    """`pdserve up --autoscale`; returns once it autoscales: the process, its output lines so far (a thread
    keeps appending), the router's HTTP base URL and metrics URL."""
    http_port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--autoscale", "--max-pods",
               str(args.max_pods), "--ttft-target", str(args.ttft_target), "--itl-target", str(args.itl_target),
               *args.planner_args.split(), "--port", str(free_port()), "--http-port", str(http_port),
               "--log-dir", str(log_dir), f"--pod-args={args.pod_args}", f"--decode-args={args.decode_args}"]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in up.stdout:
            lines.append(f"{time.time():.1f} {line.rstrip()}")
            if line.startswith("autoscaling:"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(900)
    router = next((line for line in lines if line.split()[1:2] == ["router"]), None)
    if up.poll() is not None or router is None:
        raise RuntimeError("pdserve up --autoscale did not start:\n" + "\n".join(lines[-30:]))
    metrics_url = router.split("metrics ")[1].split()[0]
    return up, lines, f"http://127.0.0.1:{http_port}/v1", metrics_url


async def drive(args: argparse.Namespace, phases: list[Phase], http_url: str, metrics_url: str):
    started = time.monotonic()
    samples: list[tuple[float, int, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_rotation(metrics_url, started, samples, stop))
    records = await run_load(http_url, phases, args.rate, args.jitter, args.seed, started)
    await asyncio.sleep(WINDOW_S)  # the last decisions after the load
    stop.set()
    await sampler
    return records, samples


def p90(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def summarise(args: argparse.Namespace, phases: list[Phase], records: list[Record], samples) -> dict:
    rows, edge = [], 0.0
    for index, phase in enumerate(phases):
        mine = [r for r in records if r.phase == index]
        window = [s for s in samples if edge <= s[0] < edge + phase.seconds]
        within = [r for r in mine if not r.is_lost and r.ttft_s <= args.ttft_target and r.itl_s is not None
                  and r.itl_s <= args.itl_target]
        rows.append({"phase": phase.label(), "start_s": edge, "seconds": phase.seconds, "requests": len(mine),
                     "lost": sum(r.is_lost for r in mine), "ttft_p90_s": p90([r.ttft_s for r in mine]),
                     "itl_p90_s": p90([r.itl_s for r in mine]),
                     "within_both_targets": len(within) / len(mine) if mine else None,
                     "decode_pods_mean": sum(s[2] for s in window) / len(window) if window else None,
                     "decode_pods_max": max((s[2] for s in window), default=None),
                     "prefill_pods_max": max((s[1] for s in window), default=None)})
        edge += phase.seconds
    return {"phases": rows, "decode_changes": _changes(samples, 2), "prefill_changes": _changes(samples, 1),
            "lost": sum(r.is_lost for r in records), "requests": len(records),
            "errors": sorted({r.error for r in records if r.error})[:5]}


def _changes(samples, column: int) -> list[tuple[float, int, int]]:
    """(time, from, to) each time the tier's count in rotation changed."""
    return [(now[0], before[column], now[column]) for before, now in zip(samples, samples[1:])
            if now[column] != before[column]]


def windows(records: list[Record], end_s: float) -> list[tuple[float, float | None, float | None]]:
    out, start = [], 0.0
    while start < end_s:
        mine = [r for r in records if start <= r.sent_s < start + WINDOW_S and not r.is_lost]
        out.append((start + WINDOW_S / 2, p90([r.ttft_s for r in mine]), p90([r.itl_s for r in mine])))
        start += WINDOW_S
    return out


def plot(path: Path, args, phases: list[Phase], samples, points) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    times = [s[0] for s in samples]
    axes[0].step(times, [s[1] for s in samples], where="post", label="prefill pods")
    axes[0].step(times, [s[2] for s in samples], where="post", label="decode pods")
    axes[0].set_ylabel("pods in rotation")
    axes[0].set_ylim(0, args.max_pods + 0.5)
    for axis, column, target, name in ((axes[1], 1, args.ttft_target, "TTFT p90 (s)"),
                                       (axes[2], 2, args.itl_target * 1000, "ITL p90 (ms)")):
        scale = 1000 if column == 2 else 1
        shown = [(p[0], p[column] * scale) for p in points if p[column] is not None]
        axis.plot([p[0] for p in shown], [p[1] for p in shown], marker="o")
        axis.axhline(target, color="red", linestyle="--", label="target")
        axis.set_ylabel(name)
        axis.set_yscale("log")
    edge = 0.0
    for phase in phases:
        for axis in axes:
            axis.axvline(edge, color="grey", linewidth=0.5)
        axes[0].text(edge + 2, args.max_pods + 0.15, f"prompt:output {phase.label()}", fontsize=8)
        edge += phase.seconds
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].set_xlabel(f"seconds (p90s over requests sent in each {WINDOW_S:.0f} s)")
    figure.suptitle("pdserve up --autoscale, tiny preset, 2-core VM")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> int:
    args = parse_args()
    phases = [Phase(*(int(x) for x in spec.split(":")[:2]), float(spec.split(":")[2]))
              for spec in args.phases.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((args.out / f"{args.name}_run.json").read_text())
        plot(args.out / f"{args.name}_timeline.png", args, phases, saved["timeline"], saved["windows"])
        return 0
    up, lines, http_url, metrics_url = start_up(args, Path("/tmp") / f"pdserve-planner-run-{time.time():.0f}")
    try:
        records, samples = asyncio.run(drive(args, phases, http_url, metrics_url))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(600)
    result = summarise(args, phases, records, samples)
    result.update(settings={k: str(v) for k, v in vars(args).items()}, timeline=samples,
                  windows=windows(records, sum(p.seconds for p in phases)),
                  scaling_log=[line for line in lines if "autoscale:" in line or "planner decision" in line],
                  records=[[r.phase, round(r.sent_s, 2), r.num_asked, r.num_tokens, r.ttft_s, r.itl_s, r.error]
                           for r in records])
    (args.out / f"{args.name}_run.json").write_text(json.dumps(result, indent=1))
    plot(args.out / f"{args.name}_timeline.png", args, phases, samples, result["windows"])
    print_table(result)
    return 0 if result["lost"] == 0 else 1


def print_table(result: dict) -> None:
    print(f"{'phase':>9} {'requests':>8} {'lost':>5} {'TTFT p90':>9} {'ITL p90':>8} {'in targets':>10} "
          f"{'decode pods mean/max':>20}")
    for row in result["phases"]:
        ttft = f"{row['ttft_p90_s']:.2f} s" if row["ttft_p90_s"] is not None else "-"
        itl = f"{row['itl_p90_s'] * 1000:.0f} ms" if row["itl_p90_s"] is not None else "-"
        within = f"{row['within_both_targets']:.0%}" if row["within_both_targets"] is not None else "-"
        pods = f"{row['decode_pods_mean']:.2f}/{row['decode_pods_max']}" if row["decode_pods_mean"] else "-"
        print(f"{row['phase']:>9} {row['requests']:>8} {row['lost']:>5} {ttft:>9} {itl:>8} {within:>10} {pods:>20}")
    print("decode pods in rotation changed at: " + ", ".join(f"{t:.0f} s ({a}->{b})"
                                                            for t, a, b in result["decode_changes"]))
    print("prefill pods changed at: " + (", ".join(f"{t:.0f} s ({a}->{b})" for t, a, b in result["prefill_changes"])
                                         or "never"))
    print(f"lost requests: {result['lost']} of {result['requests']}" +
          (f" ({'; '.join(result['errors'])})" if result["errors"] else ""))


if __name__ == "__main__":
    sys.exit(main())
