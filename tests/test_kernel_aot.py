"""The Triton attention kernels compile for an H200 (sm_90) on this GPU-less machine, as a launch there
would compile them, and the production shapes spill no registers (scripts/kernel_aot_check.py).

The interpreter tests (test_triton_attention.py) check what the kernels compute; only a real compile
checks the GPU path: bfloat16 tl.dot on tensor cores, the layouts, and the registers each thread needs.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.e2e  # a subprocess (the interpreter must be off) and about 10 s of compiling

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernel_aot_check.py"
# Per preset and dtype: decode with one split, with several (and its merge), and prefill; then the
# same with a sliding window.
LAUNCHES = [("decode_split_kernel", "decode, 1 split"), ("decode_split_kernel", "decode, 8 splits"),
            ("decode_reduce_kernel", "decode, 8 splits"), ("prefill_kernel", "prefill")]


@pytest.mark.parametrize("preset, dtype", [
    ("llama3-8b", "bfloat16"),  # the GPU benchmarks' model
    ("tiny", "float32"),  # what the GPU tests compare with the CPU path
])
def test_kernels_compile_for_h200_without_spills(preset, dtype, tmp_path):
    report = tmp_path / "kernels.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", preset, "--dtype", dtype, "--arch", "90",
         "--max-spill-bytes", "0", "--json", str(report)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(report.read_text())
    expected = LAUNCHES + [(kernel, f"{case}, window 512") for kernel, case in LAUNCHES]
    assert [(row["kernel"], row["case"]) for row in rows] == expected
    for row in rows:
        assert 0 < row["registers"] <= 255
        assert row["spill_store_bytes"] == 0
        assert 0 < row["shared_bytes"] <= 227 * 1024  # an H200 block's shared memory limit
