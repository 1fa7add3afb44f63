"""The pull/push KV benchmark, tiny, on the CPU: two NIXL processes, every way of every case
checked byte for byte (the benchmark raises on a mismatch) and reported in its JSON."""
import json

import pytest

from benchmarks import bench_kv_push_pull as bench

pytestmark = pytest.mark.e2e


def test_block_ids_rotate_between_the_pool_halves():
    shape = bench._handoff_shape(layers=2, max_tokens=64)  # 4 blocks at most: an 8-block pool
    case = bench.Case("64 tokens", 64, 4)
    assert [bench._block_ids(case, shape, r)[0] for r in range(4)] == [0, 4, 0, 4]
    assert shape.num_tensors == 4 and shape.block_bytes == 32 * 1024
    assert bench._handoff_shape(32, 4096).num_tensors * shape.block_bytes // bench.BLOCK_TOKENS == 128 * 1024


def test_tiny_cpu_run_reports_every_way_of_every_case(tmp_path):
    path = tmp_path / "kv.json"
    bench.main(["--device", "cpu", "--tokens", "16", "48", "--layers", "2", "--repeats", "2", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["nixl_module"] in ("nixl_cu12", "nixl_cu13")
    assert [row["case"] for row in report["rows"]] == ["raw 64 MiB", "16 tokens", "48 tokens"]
    assert [row["num_bytes"] for row in report["rows"]] == [64 << 20, 4 * 32 * 1024, 3 * 4 * 32 * 1024]
    assert [row["num_descriptors"] for row in report["rows"]] == [1, 4, 4]
    for row in report["rows"]:
        for way in ("read", "read_notif", "write", "write_notif"):
            assert len(row[way]["seconds"]) == 2
            assert 0 < row[way]["median_gb_per_s"] <= row[way]["best_gb_per_s"]
    assert report["target"]["min_gb_per_s"] == 100.0
    assert report["target"]["met"] == (report["target"]["read_64mib_median_gb_per_s"] >= 100.0)
