"""KV-aware routing against least-loaded, in one run: 2 prefill + 2 decode pods (tiny preset) and a
router per arm, the same seeded multi-turn workload against each, arms alternating over repeats.
Writes results.json, summary.md (per-turn table and the verdict) and ttft_by_turn.png.

Run from the repo root:
    python benchmarks/bench_kv_routing.py [--repeats 2] [--out-dir docs/bench/kv_routing]
    python benchmarks/bench_kv_routing.py --render-only   # table and plot again from results.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.bench_multiturn import MultiTurnConfig, markdown_table, run_multi_turn  # noqa: E402
from pdserve.launcher import LocalCluster  # noqa: E402

BLOCK_SIZE = 16
POD_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", "2048",
            "--num-threads", "1"]
# A follow-up turn leaves its decode pod one user message (48 tokens) plus at most the partial block
# before it to compute: under 96, it skips the prefill tier.
LOCAL_PREFILL_BELOW = 96
ARMS = {
    "least-loaded": ["--policy", "least-loaded"],
    "kv-aware": ["--policy", "kv-aware", "--local-prefill-below", str(LOCAL_PREFILL_BELOW)],
}


def run_arm(name: str, config: MultiTurnConfig, log_dir: Path, repeat: int) -> dict:
    with LocalCluster.start(pod_args=POD_ARGS, router_args=ARMS[name], num_prefill=2, num_decode=2,
                            with_metrics=True, log_dir=log_dir / f"{name}-{repeat}") as cluster:
        time.sleep(1.5)  # the router's first poll opens its KV event streams
        urls = [s.metrics_url for s in cluster.services if s.name != "router"]
        report = asyncio.run(run_multi_turn(cluster.router.address, config, urls, label=f"{name} #{repeat + 1}"))
    report["arm"] = name
    report["load_average"] = os.getloadavg()
    return report


def verdict(reports: list[dict]) -> list[str]:
    """The issue's three criteria, from the medians over repeats."""
    def median(arm: str, value) -> float:
        return statistics.median(value(r) for r in reports if r["arm"] == arm)

    ttft = {a: median(a, lambda r: r["ttft_ms_later_turns"]["p50"]) for a in ARMS}
    pulled = {a: median(a, lambda r: r["kv_bytes_pulled"]) for a in ARMS}
    tput = {a: median(a, lambda r: r["output_throughput"]) for a in ARMS}
    base, kv = "least-loaded", "kv-aware"
    return [
        f"- TTFT p50, turns 2+: least-loaded {ttft[base]:.1f} ms, kv-aware {ttft[kv]:.1f} ms "
        f"({ttft[base] / ttft[kv]:.2f}x lower; target >= 2x)",
        f"- KV bytes pulled, all turns: least-loaded {pulled[base]:,.0f}, kv-aware {pulled[kv]:,.0f} "
        f"({1 - pulled[kv] / pulled[base]:.0%} lower; target >= 50%)",
        f"- output throughput (tokens/s over the turns' wall time): least-loaded {tput[base]:.0f}, "
        f"kv-aware {tput[kv]:.0f} (target: no worse)",
    ]


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for report in reports:
        turns = [t["turn"] + 1 for t in report["turns"]]
        style = "-" if report["arm"] == "kv-aware" else "--"
        axes[0].plot(turns, [t["ttft_ms"]["p50"] for t in report["turns"]], style, marker="o", label=report["label"])
        axes[1].plot(turns, [t["kv_bytes_pulled"] / 2**20 for t in report["turns"]], style, marker="o",
                     label=report["label"])
        axes[2].plot(turns, [100 * (t["prefix_hit_rate"] or 0) for t in report["turns"]], style, marker="o",
                     label=report["label"])
    for ax, name in zip(axes, ("TTFT p50 (ms)", "KV pulled (MiB)", "prefix hit rate (%)")):
        ax.set_xticks(range(1, len(reports[0]["turns"]) + 1))
        ax.set_xlabel("turn")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("multi-turn, 2 prefill + 2 decode pods (tiny): KV-aware vs least-loaded routing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_arms(args: argparse.Namespace) -> list[dict]:
    config = MultiTurnConfig(num_conversations=args.num_conversations, num_turns=args.num_turns,
                             system_prompt_len=256, user_len=48, output_len=64, think_time_s=args.think_time_s)
    reports = []
    for repeat in range(args.repeats):
        order = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
        for name in order:
            print(f"repeat {repeat + 1}: {name} ...", file=sys.stderr, flush=True)
            reports.append(run_arm(name, config, args.log_dir, repeat))
    for report in reports:
        for turn in report["turns"]:
            turn.pop("ttft_values_ms")
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=5)
    parser.add_argument("--think-time-s", type=float, default=0.3)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench/kv_routing"))
    parser.add_argument("--log-dir", type=Path, default=Path("out/bench_kv_routing/logs"))
    parser.add_argument("--render-only", action="store_true", help="rewrite summary.md and the plot from results.json")
    args = parser.parse_args()
    results = args.out_dir / "results.json"
    if args.render_only:
        reports = json.loads(results.read_text())
    else:
        reports = run_arms(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(reports, indent=1))
    loads = ", ".join(f"{r['label']} {r['load_average'][0]:.1f}" for r in reports)
    summary = (
        "# KV-aware routing vs least-loaded (multi-turn)\n\n"
        f"Command: `python benchmarks/bench_kv_routing.py --repeats {len(reports) // len(ARMS)}`; workload "
        f"`{json.dumps(reports[0]['workload'])}`; pods `{' '.join(POD_ARGS)}`; kv-aware router "
        f"`{' '.join(ARMS['kv-aware'])}`. Load average (1 min) after each arm, on a 2-core machine shared with "
        f"other work: {loads}. Medians over repeats:\n\n" + "\n".join(verdict(reports)) + "\n\n"
        "Per turn (out tok/s: the turn's output tokens over its wall time, think times included):\n\n"
        + markdown_table(reports)
    )
    (args.out_dir / "summary.md").write_text(summary)
    plot(reports, args.out_dir / "ttft_by_turn.png")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
