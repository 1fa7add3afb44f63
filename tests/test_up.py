"""`pdserve up` as a local cluster of any shape: the pods split this machine's CPUs between them without
overlap (each pinned, with as many torch threads as CPUs), the start-up printout names each pod's cores
and dtype, and the example question is answered through the router."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colocated_svc.__main__ import build_arg_parser as colocated_arg_parser
from pdserve.cli import _parser as pdserve_arg_parser
from pdserve.launcher import cores_text, free_ports, split_cores
from pdserve.up import colocated_command
from shared.serving.openai.config import HttpConfig
from shared.serving.openai.tool_calls import ToolCallParser
from shared.serving.server.settings import config_from_args


def test_cores_split_into_disjoint_even_runs():
    assert split_cores(3, range(8)) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_cores(2, [0, 1]) == [(0,), (1,)]
    assert split_cores(1, [4, 2]) == [(2, 4)]
    assert split_cores(3, [0, 1]) is None  # more pods than CPUs: none is pinned
    shares = split_cores(2)
    assert sum(len(s) for s in shares or ()) in (0, len(os.sched_getaffinity(0)))


def test_cores_text():
    assert cores_text((0, 1, 2, 3, 6)) == "0-3,6"
    assert cores_text((5,)) == "5"
    assert cores_text(None) == "any"


def test_up_colocated_passes_the_http_front_flags():
    """`up --colocated` serves the API from the colocated server, so the HTTP front's flags go to it (a client
    asking for the served name, or for tool_choice "auto", was refused)."""
    args = pdserve_arg_parser().parse_args(["up", "--colocated", "--model", "tiny", "--served-model-name",
                                            "smollm2", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    colocated_args = colocated_arg_parser().parse_args(colocated_command(args, num_threads=2))
    http = config_from_args(HttpConfig, colocated_args)
    assert (http.served_model_name, http.tool_call_parser, http.reasoning_parser.value) == (
        "smollm2", ToolCallParser.HERMES, "qwen3")


def _up(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    first = free_ports(5)  # router, HTTP, prefill, and two decode pods, which take consecutive ports
    ports = [str(first + i) for i in range(4)]
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--port", ports[0], "--http-port",
               ports[1], "--prefill-port", ports[2], "--decode-port", ports[3], "--log-dir",
               str(tmp_path / "logs"), "--demo", "--max-tokens", "8", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_up_runs_any_shape_with_pinned_pods_and_answers(tmp_path):
    done = _up(tmp_path, "--prefill-pods", "1", "--decode-pods", "2", "--dtype", "float32",
               "--pod-args=--max-num-seqs 8 --num-blocks 128")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    pods = [line for line in lines if line.strip().startswith(("prefill-", "decode-"))]
    assert [line.split()[0] for line in pods] == ["prefill-0", "decode-0", "decode-1"]
    assert all("dtype float32 (as asked)" in line for line in pods), done.stdout
    if len(os.sched_getaffinity(0)) >= 3:  # each pod its own CPUs
        cores = [line.split("cores ")[1].split()[0] for line in pods]
        assert len(set(cores)) == 3 and "any" not in cores
    assert "asking 'What is the capital of France?':" in done.stdout
    answer = lines[lines.index("asking 'What is the capital of France?':") + 1]
    assert answer.strip(), done.stdout  # random weights: some text, not a given one
    # The pass-through reached the pods: their pool is the 128 blocks asked for (logged as too few for the
    # tiny model's 2,048 positions).
    assert "128 KV blocks" in (tmp_path / "logs" / "decode-1.log").read_text()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_up_colocated_answers(tmp_path):
    done = _up(tmp_path, "--colocated")
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.strip().startswith("colocated") and "cores " in line for line in done.stdout.splitlines())
    assert "asking 'What is the capital of France?':" in done.stdout


def test_up_refuses_an_empty_tier(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--decode-pods", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "--prefill-pods and --decode-pods must be >= 1" in done.stderr
