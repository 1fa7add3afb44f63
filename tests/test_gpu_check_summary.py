"""scripts/gpu_check_summary.py: stage statuses, pytest's counts, the transports UCX chose and the
serving figures, read the way scripts/gpu_check.sh leaves them."""
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gpu_check_summary", Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

UCX_LOG = """\
[1796146638.29] [gpu:3750 :0]   +--------+-------------+-----------------------------------+
[1796146638.29] [gpu:3750 :0]   | bench-decode-f53f intra-node cfg#1                        |
[1796146638.29] [gpu:3750 :0]   | remote memory read by ucp_get* from cuda memory to cuda   |
[1796146638.29] [gpu:3750 :0]   +--------+-------------+-----------------------------------+
[1796146638.29] [gpu:3750 :0]   | Range  | Description |              Config               |
[1796146638.29] [gpu:3750 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
[1796146638.30] [gpu:3750 :0]   | active message by ucp_am_send* from host memory |
[1796146638.30] [gpu:3750 :0]   |   1..16515 | zero-copy          | tcp/lo        |
KV handoff over NIXL, cuda (nixl_cu13), 10 repeats
"""


def test_stage_statuses(tmp_path):
    stages = tmp_path / "stages.tsv"
    stages.write_text("env\t0\t2.100\ntests\t1\t40.000\nkv\t124\t100.000\nserving\t200\t0.000\n")
    assert [(s["name"], s["status"]) for s in summary.read_stages(stages)] == [
        ("env", "ok"), ("tests", "failed"), ("kv", "timeout"), ("serving", "skipped")]
    assert summary.read_stages(tmp_path / "missing.tsv") == []


def test_pytest_counts_from_the_last_summary_line(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("..F.s\nFAILED tests/x.py::t - 2 passed in spirit\n3 passed, 1 failed, 1 skipped, 2 errors in 9.1s\n")
    assert summary.pytest_counts(log) == {"passed": 3, "failed": 1, "skipped": 1, "error": 2}
    log.write_text("ImportError while loading conftest\n")
    assert summary.pytest_counts(log) is None


def test_ucx_tables_name_the_rma_transport_only(tmp_path):
    log = tmp_path / "kv.log"
    log.write_text(UCX_LOG)
    assert summary.ucx_rma_transports(log) == ["remote memory read by ucp_get* from cuda memory to cuda: cuda_ipc/cuda"]


def test_summarize_reads_the_benchmarks_figures(tmp_path):
    (tmp_path / "kv_push_pull.json").write_text(json.dumps({
        "device": "cuda", "target": {"met": True},
        "rows": [{"case": "raw 64 MiB", **{way: {"median_gb_per_s": 123.456}
                                           for way in ("read", "read_notif", "write", "write_notif")}}]}))
    (tmp_path / "serving.json").write_text(json.dumps({"runs": {"split": [{
        "label": "split-rate4.0", "ttft_ms": {"p50": 30.0}, "tpot_ms": {"p50": 9.0}, "output_throughput": 250.0,
        "num_completed": 40, "num_failed": 0, "errors": []}]}}))
    result = summary.summarize(tmp_path / "stages.tsv", tmp_path / "tests.log", tmp_path / "kv.log", tmp_path, "gpu")
    assert result["kv_transfer"]["gb_per_s_median"]["raw 64 MiB"]["read"] == 123.46
    assert result["serving"]["split-rate4.0"]["ttft_p50_ms"] == 30.0
    assert result["gpu_step"] is None and result["tests"] is None and result["kv_transports"] == []


def _report(label, ttft, tpot):
    return {"label": label, "system": label.split("-rate")[0], "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot},
            "output_throughput": 100.0, "num_completed": 40, "num_failed": 0, "errors": [],
            "requests": [{"ttft_s": ttft / 1e3}]}


def test_serving_json_gathered_from_the_runs_finished_so_far(tmp_path):
    serving_dir = tmp_path / "serving"
    serving_dir.mkdir()
    (serving_dir / "split-rate4.0.json").write_text(json.dumps(_report("split-rate4.0", 30.0, 9.0)))
    (serving_dir / "sweep.json").write_text("{}")  # not a run report
    result = summary.summarize(tmp_path / "stages.tsv", tmp_path / "tests.log", tmp_path / "kv.log", tmp_path,
                               "gpu", serving_dir)
    assert list(result["serving"]) == ["split-rate4.0"]
    written = json.loads((tmp_path / "serving.json").read_text())
    assert "requests" not in written["runs"]["split"][0]
    split_ttft = next(t for t in result["targets"] if t["name"].startswith("split ttft"))
    assert split_ttft["measured"] is None and split_ttft["met"] is None  # colocated has not run yet


def test_targets_name_each_figure_against_issue_15(tmp_path):
    step_rows = [{"case": "decode batch 1", "cuda_graphs": False, "median_ms": 7.0},
                 {"case": "decode batch 1", "cuda_graphs": True, "median_ms": 5.0},
                 {"case": "decode batch 32", "cuda_graphs": True, "median_ms": 6.6},
                 {"case": "prefill 2048 tokens", "cuda_graphs": False, "median_ms": 69.0}]
    (tmp_path / "gpu_step.json").write_text(json.dumps({"rows": step_rows}))
    (tmp_path / "kv_push_pull.json").write_text(json.dumps({"rows": [], "target": {
        "read_64mib_median_gb_per_s": 120.0, "min_gb_per_s": 100.0, "met": True}}))
    serving_dir = tmp_path / "serving"
    serving_dir.mkdir()
    (serving_dir / "split-rate4.0.json").write_text(json.dumps(_report("split-rate4.0", 36.0, 10.0)))
    (serving_dir / "colocated-rate4.0.json").write_text(json.dumps(_report("colocated-rate4.0", 30.0, 10.0)))
    result = summary.summarize(tmp_path / "stages.tsv", tmp_path / "tests.log", tmp_path / "kv.log", tmp_path,
                               "gpu", serving_dir)
    by_name = {t["name"].split(",")[0].split(":")[0]: t for t in result["targets"]}
    assert (by_name["decode batch 1"]["measured"], by_name["decode batch 1"]["met"]) == (5.0, True)
    assert by_name["decode batch 1"]["cuda_graphs"] is True  # the row a pod replays, not the eager one
    assert by_name["decode batch 32"]["met"] is False and by_name["decode batch 32"]["target"] == "<= 6.5 ms"
    assert by_name["decode batch 128"]["measured"] is None and by_name["decode batch 128"]["met"] is None
    assert by_name["prefill 2048 tokens"]["met"] is True
    assert by_name["KV pull (NIXL READ) of 64 MiB"]["target"] == ">= 100 GB/s"
    assert by_name["KV pull (NIXL READ) of 64 MiB"]["met"] is True
    ttft, tpot = (t for t in result["targets"] if t["name"].startswith("split"))
    assert (ttft["measured"], ttft["met"]) == (0.2, False)  # 36 ms is 20% above 30 ms
    assert (tpot["measured"], tpot["met"]) == (0.0, True)


def test_the_dry_run_lists_figures_without_judging_them(tmp_path):
    (tmp_path / "gpu_step.json").write_text(json.dumps({"rows": [
        {"case": "decode batch 1", "cuda_graphs": False, "median_ms": 40.0}]}))
    result = summary.summarize(tmp_path / "stages.tsv", tmp_path / "tests.log", tmp_path / "kv.log", tmp_path,
                               "dry-run")
    step = result["targets"][0]
    assert (step["measured"], step["met"]) == (40.0, None)
