"""Gather scripts/gpu_check.sh's stages into one JSON file (OUT/gpu_check.json) and print it short.

Reads the stage table the script wrote (name, exit status, seconds per line), the tests' summary line,
the transports UCX chose for the kv stage's READs and WRITEs (its UCX_PROTO_INFO tables),
and the figures the benchmarks left in OUT: gpu_step.json (bench_gpu_step.py), kv_push_pull.json
(bench_kv_push_pull.py) and serving.json, which it writes itself from the per-run reports
serving_sweep.py left in --serving-dir (each written as its run ends, so a sweep cut short still counts).
"targets" holds each figure of issue 15 beside its target, and whether it met it (None: not measured).
The script runs this after every stage, so gpu_check.json is current even if the whole run is cut short.

    python scripts/gpu_check_summary.py --stages WORK/stages.tsv --tests-log OUT/tests.log \
        --kv-log WORK/kv.log --serving-dir WORK/serving --out OUT
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TIMEOUT_EXIT_CODES = (124, 137)
UCX_TABLE_ROW = re.compile(r"^\[[^]]*\] \[[^]]*\]\s+\|(.*)\|\s*$")  # a UCX_PROTO_INFO table line
UCX_RANGE = re.compile(r"^(\d+|\d+\.\.(\d+|inf))$")  # timeout(1) ran out; killed after the grace time
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
# Issue 15's targets on the H200 (llama3-8b, bf16): bench_gpu_step.py's cases by name, at most these ms.
STEP_TARGETS_MS = {
    "decode batch 1": 5.5,
    "decode batch 32": 6.5,  # contexts 768..1280 (about 1k)
    "decode batch 128": 10.5,  # contexts 1,024
    "prefill 2048 tokens": 70.0,
}
# Split TTFT p50 and TPOT p50 at rate 4 within this fraction above the colocated server's.
SPLIT_OVER_COLOCATED_MAX = 0.15
SERVING_RATE_LABEL = "rate4.0"


def read_stages(path: Path) -> list[dict]:
    stages = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, exit_code, seconds = line.split("\t")
        code = int(exit_code)
        if code == 0:
            status = "ok"
        elif code in TIMEOUT_EXIT_CODES:
            status = "timeout"
        elif code == 200:  # the script's own code for a stage it did not run
            status = "skipped"
        else:
            status = "failed"
        stages.append({"name": name, "status": status, "exit_code": code, "seconds": round(float(seconds), 1)})
    return stages


def pytest_counts(log: Path) -> dict[str, int] | None:
    """The counts of pytest's last summary line ('3 passed, 1 skipped in 9.1s'); None without one."""
    if not log.exists():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                  for n, kind in PYTEST_COUNTS.findall(line)}
        if counts and " in " in line:
            return counts
    return None


def ucx_rma_transports(log: Path) -> list[str]:
    """From a UCX_PROTO_INFO=y log: 'remote memory read/write ... : transport' for each table UCX printed.

    On one GPU the device-memory READ and WRITE should name cuda_ipc; tcp there is the slow fallback.
    """
    if not log.exists():
        return []
    found: dict[str, None] = {}
    title = ""
    for line in log.read_text(errors="replace").splitlines():
        match = UCX_TABLE_ROW.match(line)
        if not match:
            continue
        cells = [cell.strip() for cell in match.group(1).split("|")]
        if len(cells) == 1:
            title = cells[0] if "remote memory" in cells[0] else ""
        elif len(cells) == 3 and title and UCX_RANGE.match(cells[0]):
            found[f"{title}: {cells[2]}"] = None
    return list(found)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kv_figures(report: dict | None) -> dict | None:
    """Median GB/s per case and way, and the 64 MiB READ target."""
    if report is None:
        return None
    ways = ("read", "read_notif", "write", "write_notif")
    return {
        "device": report.get("device"),
        "gb_per_s_median": {row["case"]: {way: round(row[way]["median_gb_per_s"], 2) for way in ways}
                            for row in report.get("rows", [])},
        "target": report.get("target"),
    }


def serving_figures(sweep: dict | None) -> dict | None:
    """TTFT p50 and TPOT p50 (ms), output tokens/s and failures, per system and rate."""
    if sweep is None:
        return None
    figures = {}
    for system, runs in sweep.get("runs", {}).items():
        for run in runs:
            figures[run.get("label", system)] = {
                "ttft_p50_ms": (run.get("ttft_ms") or {}).get("p50"),
                "tpot_p50_ms": (run.get("tpot_ms") or {}).get("p50"),
                "output_tokens_per_s": run.get("output_throughput"),
                "num_completed": run.get("num_completed"),
                "num_failed": run.get("num_failed"),
                "errors": run.get("errors"),
            }
    return figures


def serving_runs(serving_dir: Path | None) -> dict | None:
    """serving_sweep.py's per-run reports (<system>-rate<R>.json, less each request's detail) shaped like
    its sweep.json ({"runs": {system: [report, ...]}}); None when no run has finished."""
    if serving_dir is None:
        return None
    runs: dict[str, list[dict]] = {}
    for path in sorted(serving_dir.glob("*-rate*.json")):
        report = _load(path)
        if report is None or "label" not in report:
            continue
        system = report.get("system", report["label"].split("-rate")[0])
        runs.setdefault(system, []).append({key: value for key, value in report.items() if key != "requests"})
    return {"runs": runs} if runs else None


def _target(name: str, measured: float | None, target: float, unit: str, at_most: bool, judged: bool) -> dict:
    met = None if measured is None or not judged else (measured <= target if at_most else measured >= target)
    return {"name": name, "measured": None if measured is None else round(measured, 3),
            "target": f"{'<=' if at_most else '>='} {target:g}{' ' + unit if unit else ''}", "met": met}


def step_row(gpu_step: dict | None, case: str) -> dict:
    """A case's row: its CUDA-graph row where there is one (what a pod replays), else the eager one."""
    rows = [row for row in (gpu_step or {}).get("rows", []) if row.get("case") == case]
    rows.sort(key=lambda row: not row.get("cuda_graphs"))
    return rows[0] if rows else {}


def targets(gpu_step: dict | None, kv_report: dict | None, serving: dict | None, judged: bool = True) -> list[dict]:
    """Each figure of issue 15 against its target; measured None (met None) where the run has none.
    judged False (the CPU dry run): the figures are listed, met stays None."""
    found = []
    for case, limit in STEP_TARGETS_MS.items():
        row = step_row(gpu_step, case)
        found.append(_target(f"{case}: median step", row.get("median_ms"), limit, "ms", at_most=True,
                             judged=judged))
        found[-1]["cuda_graphs"] = row.get("cuda_graphs")
    read = ((kv_report or {}).get("target") or {}).get("read_64mib_median_gb_per_s")
    found.append(_target("KV pull (NIXL READ) of 64 MiB: median", read, 100.0, "GB/s", at_most=False,
                         judged=judged))
    runs = serving or {}
    split, colocated = runs.get(f"split-{SERVING_RATE_LABEL}", {}), runs.get(f"colocated-{SERVING_RATE_LABEL}", {})
    for figure in ("ttft_p50_ms", "tpot_p50_ms"):
        ratio = None
        if split.get(figure) is not None and colocated.get(figure):
            ratio = split[figure] / colocated[figure] - 1.0
        found.append(_target(f"split {figure} / colocated {figure} - 1, rate 4", ratio,
                             SPLIT_OVER_COLOCATED_MAX, "", at_most=True, judged=judged))
    return found


def summarize(stages_path: Path, tests_log: Path, kv_log: Path, out: Path, mode: str,
              serving_dir: Path | None = None) -> dict:
    """Also writes out/serving.json from serving_dir's per-run reports, when there are any."""
    runs = serving_runs(serving_dir)
    if runs is not None:
        (out / "serving.json").write_text(json.dumps(runs, indent=1))
    gpu_step = _load(out / "gpu_step.json")
    kv_report = _load(out / "kv_push_pull.json")
    serving = serving_figures(_load(out / "serving.json"))
    return {
        "mode": mode,
        "stages": read_stages(stages_path),
        "targets": targets(gpu_step, kv_report, serving, judged=mode == "gpu"),
        "tests": pytest_counts(tests_log),
        "gpu_step": gpu_step,
        "kv_transfer": kv_figures(kv_report),
        "kv_transports": ucx_rma_transports(kv_log),
        "serving": serving,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=Path, required=True)
    parser.add_argument("--tests-log", type=Path, required=True)
    parser.add_argument("--kv-log", type=Path, required=True, help="the kv stage's log (UCX_PROTO_INFO=y)")
    parser.add_argument("--serving-dir", type=Path, help="serving_sweep.py's --out-dir (its per-run reports)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", default="gpu")
    parser.add_argument("--quiet", action="store_true", help="write gpu_check.json only (between stages)")
    args = parser.parse_args()
    summary = summarize(args.stages, args.tests_log, args.kv_log, args.out, args.mode, args.serving_dir)
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    if not args.quiet:
        print_summary(summary)


def print_summary(summary: dict) -> None:
    print("== gpu_check summary")
    for stage in summary["stages"]:
        print(f"  {stage['name']:<10} {stage['status']:<8} {stage['seconds']:>6.1f} s")
    for target in summary["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not judged"}[target["met"]]
        print(f"  target {target['name']}: {target['measured']} ({target['target']}): {verdict}")
    print(f"  tests: {summary['tests']}")
    if summary["kv_transfer"]:
        print(f"  kv GB/s (median): {json.dumps(summary['kv_transfer']['gb_per_s_median'])}")
        print(f"  kv target: {summary['kv_transfer']['target']}")
    for transport in summary["kv_transports"]:
        print(f"  UCX: {transport}")
    if summary["serving"]:
        for label, figures in summary["serving"].items():
            print(f"  {label}: TTFT p50 {figures['ttft_p50_ms']} ms, TPOT p50 {figures['tpot_p50_ms']} ms, "
                  f"{figures['num_completed']} done, {figures['num_failed']} failed")


if __name__ == "__main__":
    main()
