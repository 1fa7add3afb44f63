"""PNG plots of benchmark reports: latency CDFs of one run, and throughput/latency against request rate
for a sweep. matplotlib is imported lazily (Agg backend) so the benchmark runs without it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _latency_values(report: Mapping[str, Any], key: str) -> list[float]:
    rows = [r for r in report["requests"] if r["error"] is None]
    if key == "itl_ms":
        return sorted(g for r in rows for g in r["itl_ms"])
    return sorted(r[key] for r in rows if r[key] is not None)


def plot_latency_cdfs(reports: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """One panel per latency (TTFT, TPOT, ITL, E2E); one CDF line per report (labelled)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for report in reports:
            values = _latency_values(report, key)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=report["label"])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate_axis(reports: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[str]]:
    """Finite rates as numbers; 'inf' drawn one step past the largest finite rate."""
    finite = [float(r["workload"]["rate"]) for r in reports if r["workload"]["rate"] != "inf"]
    inf_at = (max(finite) * 1.5) if finite else 1.0
    xs = [inf_at if r["workload"]["rate"] == "inf" else float(r["workload"]["rate"]) for r in reports]
    return xs, ["inf" if r["workload"]["rate"] == "inf" else f"{x:g}" for r, x in zip(reports, xs)]


def plot_sweep(sweeps: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str = "") -> Path:
    """sweeps: system name -> its reports in rate order. Panels: output tok/s, TTFT p50, TPOT p50, and
    goodput (completed requests/s when no SLO was given)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    has_goodput = any(r["goodput"] is not None for reports in sweeps.values() for r in reports)
    panels = (
        (lambda r: r["output_throughput"], "output tokens/s"),
        (lambda r: r["ttft_ms"]["p50"], "TTFT p50 (ms)"),
        (lambda r: r["tpot_ms"]["p50"], "TPOT p50 (ms)"),
        (lambda r: r["goodput"], "goodput (req/s)") if has_goodput
        else (lambda r: r["request_throughput"], "completed requests/s"),
    )
    for ax, (value, name) in zip(axes.flat, panels):
        for system, reports in sweeps.items():
            xs, ticks = _rate_axis(reports)
            ys = [value(r) for r in reports]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=system)
            ax.set_xticks(xs, ticks)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "serving sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
