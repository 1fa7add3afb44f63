"""benchmarks/bench_gpu_step.py: its CPU smoke run on the tiny preset (every case runs through the real
runner and lands in the JSON), its refusals, and the prefill FLOP count it rates the GPU by."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.model.model_config import preset

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_flops_of_llama3_8b(bench):
    flops = bench.prefill_flops(preset("llama3-8b"), 2048)
    # 2 x 6.98e9 layer parameters x 2,048 tokens, plus causal attention and one logit row.
    layer_params = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096)
    attention = 32 * 4 * 32 * 128 * 2048 * 2049 / 2
    assert flops == pytest.approx(2 * layer_params * 2048 + attention + 2 * 4096 * 128256)


@pytest.mark.e2e  # a whole benchmark run (model, runner, every case): seconds, so the slow lane
def test_cpu_smoke_run_writes_every_case(bench, tmp_path, monkeypatch):
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["bench_gpu_step.py", "--device", "cpu", "--preset", "tiny", "--quick",
                                      "--warmups", "1", "--repeats", "2", "--json", str(out)])
    assert bench.main() == 0
    result = json.loads(out.read_text())
    cases = [row["case"] for row in result["rows"]]
    assert cases == ["decode batch 1", "decode batch 4", "decode batch 8", "prefill 128 tokens"]
    assert all(row["median_ms"] > 0 for row in result["rows"])


def test_refuses_without_a_gpu_or_with_the_8b_on_the_cpu(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_gpu_step.py", "--device", "cpu"])
    assert bench.main() == 2
    assert "for the GPU" in capsys.readouterr().err
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_gpu_step.py"])
    assert bench.main() == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.e2e  # builds the model and runs its decode cases: seconds
def test_a_run_cut_short_keeps_the_cases_it_measured(bench, tmp_path, monkeypatch):
    """The GPU check's time limit can stop the bench mid-run: each case is in the JSON once measured."""
    out = tmp_path / "step.json"

    def cut_short(*args):
        raise KeyboardInterrupt  # as a timeout would stop it

    monkeypatch.setattr(bench, "prefill_case", cut_short)
    monkeypatch.setattr(sys, "argv", ["bench_gpu_step.py", "--device", "cpu", "--preset", "tiny", "--quick",
                                      "--warmups", "1", "--repeats", "1", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    cases = [row["case"] for row in json.loads(out.read_text())["rows"]]
    assert cases == ["decode batch 1", "decode batch 4", "decode batch 8"]


@pytest.mark.e2e  # a subprocess
def test_runner_host_bench_times_every_case():
    """benchmarks/bench_runner_host.py (the host share of a step): every case prints a figure."""
    script = SCRIPT.parent / "bench_runner_host.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "10", "--context", "64", "--prefill-tokens", "128"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "median" in line]
    assert [line.split("median")[0].strip() for line in lines] == [
        "decode batch   1", "decode batch  32", "decode batch 128", "prefill 128 tokens"]
