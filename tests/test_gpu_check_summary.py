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
