"""Two checkouts side by side in one run: offline throughput (bench_throughput.py's workload), the serving
sweep at one rate (serving_sweep.py) and the KV pull (bench_kv_push_pull.py's READ), each measured on the
"before" checkout and then the "after" one, with that checkout's own scripts and interpreter.

    git worktree add --detach /tmp/before de7f3f8        # the older commit (give it a venv, or share ours)
    nice -n 10 python benchmarks/bench_before_after.py --before /tmp/before [--after .] [--out-dir out/before_after]

A checkout's interpreter is its .venv/bin/python when it has one, else this one with the checkout first on
PYTHONPATH. The machine is shared: each figure carries the 1-minute load average it started under.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OFFLINE_MEDIAN = re.compile(r"^(\S+) \(.*\): median ([\d,]+) output tokens/s", re.MULTILINE)


@dataclass(frozen=True)
class Checkout:
    label: str
    path: Path

    @property
    def python(self) -> str:
        own = self.path / ".venv" / "bin" / "python"
        return str(own) if own.exists() else sys.executable

    @property
    def commit(self) -> str:
        return subprocess.run(["git", "-C", str(self.path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()

    def run(self, args: list[str], timeout_s: float) -> str:
        """Run one of its benchmarks (python + args, from its root); its stdout. RuntimeError when it fails."""
        env = dict(os.environ, PYTHONPATH=str(self.path))
        done = subprocess.run([self.python, *args], cwd=self.path, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{self.label}: {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout


def load_average() -> float:
    return os.getloadavg()[0]


def offline_throughput(checkout: Checkout, models: list[str], runs: int) -> dict[str, float]:
    """model -> median output tokens/s of bench_throughput.py's workload."""
    out = checkout.run(["benchmarks/bench_throughput.py", "--models", *models, "--runs", str(runs)], 3600)
    return {model: float(tokens.replace(",", "")) for model, tokens in OFFLINE_MEDIAN.findall(out)}


def serving_sweep(checkout: Checkout, rate: str, systems: list[str], out_dir: Path,
                  extra: list[str]) -> dict[str, dict]:
    """system -> the sweep's report at this rate (TTFT/TPOT in ms, output tok/s, failures)."""
    run_dir = out_dir / f"sweep-{checkout.label}"
    checkout.run(["benchmarks/serving_sweep.py", "--systems", ",".join(systems), "--rates", rate,
                  "--out-dir", str(run_dir), "--no-plots", *extra], 1800)
    runs = json.loads((run_dir / "sweep.json").read_text())["runs"]
    return {system: reports[0] for system, reports in runs.items()}


def kv_pull(checkout: Checkout, tokens: list[int], repeats: int, out_dir: Path) -> dict[int, float]:
    """prompt tokens -> median GB/s of a decode-side READ of their KV (Llama-3.1-8B-shaped, CPU pools)."""
    path = out_dir / f"kv-{checkout.label}.json"
    checkout.run(["-m", "benchmarks.bench_kv_push_pull", "--device", "cpu", "--tokens", *map(str, tokens),
                  "--repeats", str(repeats), "--no-raw", "--json", str(path)], 1800)
    rows = json.loads(path.read_text())["rows"]
    return {row["tokens"]: row["read"]["median_gb_per_s"] for row in rows}


def measure(checkouts: list[Checkout], args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    """Rows (what, {label: figure}), each benchmark on every checkout in turn before the next benchmark."""
    rows: list[tuple[str, dict[str, float]]] = []

    def add(what: str, label: str, value: float, load: float) -> None:
        print(f"  {label}: {what} = {value:,.2f} (load {load:.1f})", flush=True)
        for name, values in rows:
            if name == what:
                values[label] = value
                return
        rows.append((what, {label: value}))

    for checkout in checkouts:
        load = load_average()
        for model, tokens_per_s in offline_throughput(checkout, args.models, args.runs).items():
            add(f"offline {model}: output tok/s", checkout.label, tokens_per_s, load)
    for checkout in checkouts:
        load = load_average()
        sweep = serving_sweep(checkout, args.rate, args.systems, args.out_dir, shlex.split(args.sweep_args))
        for system, report in sweep.items():
            add(f"sweep {system} rate {args.rate}: TTFT p50 ms", checkout.label, report["ttft_ms"]["p50"], load)
            add(f"sweep {system} rate {args.rate}: TPOT p50 ms", checkout.label, report["tpot_ms"]["p50"], load)
            add(f"sweep {system} rate {args.rate}: output tok/s", checkout.label, report["output_throughput"], load)
            add(f"sweep {system} rate {args.rate}: failed requests", checkout.label, report["num_failed"], load)
    for checkout in checkouts:
        load = load_average()
        for tokens, gb_per_s in kv_pull(checkout, args.kv_tokens, args.kv_repeats, args.out_dir).items():
            add(f"KV pull {tokens} tokens (8B shape): READ GB/s", checkout.label, gb_per_s, load)
    return rows


def table(checkouts: list[Checkout], rows: list[tuple[str, dict[str, float]]]) -> str:
    before, after = checkouts
    lines = [f"| measure | before `{before.commit}` | after `{after.commit}` | after / before |", "|---|---|---|---|"]
    for what, values in rows:
        b, a = values.get(before.label), values.get(after.label)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        lines.append(f"| {what} | {_figure(b)} | {_figure(a)} | {ratio} |")
    return "\n".join(lines)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the older checkout (a git worktree)")
    parser.add_argument("--after", type=Path, default=REPO, help="the newer checkout (default: this one)")
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], help="offline throughput's checkpoints")
    parser.add_argument("--runs", type=int, default=3, help="offline timed runs per model (the median is kept)")
    parser.add_argument("--rate", default="8", help="the serving sweep's request rate")
    parser.add_argument("--systems", nargs="+", default=["split", "colocated"], help="the sweep's systems")
    parser.add_argument("--sweep-args", default="", help="more serving_sweep.py flags (its workload's defaults else)")
    parser.add_argument("--kv-tokens", type=int, nargs="+", default=[512, 2048], help="KV pull prompt lengths")
    parser.add_argument("--kv-repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=REPO / "out" / "before_after")
    args = parser.parse_args(argv)
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    checkouts = [Checkout("before", args.before.resolve()), Checkout("after", args.after.resolve())]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(f"{started}: " + "; ".join(f"{c.label} {c.commit} at {c.path} ({c.python})" for c in checkouts), flush=True)
    rows = measure(checkouts, args)
    text = table(checkouts, rows)
    (args.out_dir / "before_after.md").write_text(f"# Before and after\n\nStarted {started}, {os.cpu_count()} CPUs.\n\n"
                                                  f"{text}\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
