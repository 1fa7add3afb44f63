"""The project as an image runs it: installed non-editable (the kernel prebuilt at install) into a fresh
venv, then used from outside the checkout with no compiler on PATH and no writable build folder. The
kernel must load in under 2 s and `pdserve colocated` must start and serve its health service."""
from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
# Copied into the build tree: what the sdist would hold (no caches, no build leftovers).
IGNORED = shutil.ignore_patterns(".git", "__pycache__", "build", "*.egg-info", ".venv", "venv", "*.so",
                                 ".pytest_cache", "pdserve-logs", "docs", "benchmarks")
KERNEL_LOAD_LIMIT_S = 2.0

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LOAD_SCRIPT = """
import json, logging, time
logging.basicConfig(level=logging.INFO)
import torch
started = time.perf_counter()
from shared.engine.model import kernel_build, paged_decode
is_available = paged_decode.paged_decode_available(torch.float32)
seconds = time.perf_counter() - started
print(json.dumps({"available": is_available, "seconds": seconds, "module": paged_decode.__file__,
                  "prebuilt": str(kernel_build.prebuilt_library())}))
"""


def _make_venv(root: Path) -> Path:
    """A venv without pip whose site-packages sees this interpreter's packages (torch, pip, setuptools...)
    after its own, so the install needs no network and the installed copy shadows nothing."""
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                       capture_output=True, timeout=60)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a venv here: {exc}")
    python = root / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    # Plain path lines: the shared environment's own .pth files (an editable install of the checkout,
    # for one) are not processed, so nothing from the checkout leaks in.
    Path(own_site, "shared_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("installed")
    python = _make_venv(root / "venv")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=IGNORED)
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         str(source)],
        capture_output=True, text=True, timeout=540, cwd=root,
        env={**_clean_env(os.environ["PATH"]), "MAX_JOBS": str(os.cpu_count() or 1)},
    )
    assert result.returncode == 0, f"pip install failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    shutil.rmtree(source)  # the installed package must not need its source tree
    # No compiler on PATH and a build folder that cannot be created: any build attempt fails loudly.
    blocker = root / "not-a-folder"
    blocker.write_text("")
    env = {**_clean_env(str(root / "venv" / "bin")), "CXX": "/nonexistent/c++", "CC": "/nonexistent/cc",
           "PDSERVE_KERNEL_DIR": str(blocker / "kernels")}
    return {"root": root, "python": python, "env": env}


def _clean_env(path: str) -> dict[str, str]:
    """The environment without PYTHONPATH (which would import the checkout) and with the given PATH."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TORCH_EXTENSIONS_DIR")}
    env["PATH"] = path
    env["HOME"] = os.environ.get("HOME", "/root")
    return env


def test_no_compiler_is_reachable(installed: dict) -> None:
    found = shutil.which("c++", path=installed["env"]["PATH"]) or shutil.which("g++", path=installed["env"]["PATH"])
    assert found is None


def test_the_prebuilt_kernel_loads_fast_from_the_installed_package(installed: dict) -> None:
    result = subprocess.run([str(installed["python"]), "-c", LOAD_SCRIPT], capture_output=True, text=True,
                            timeout=120, cwd=installed["root"], env=installed["env"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(installed["root"] / "venv")), report
    assert report["prebuilt"].endswith(".so"), report
    assert report["available"], result.stderr
    assert "prebuilt at install" in result.stderr
    print(f"kernel loaded from the installed package in {report['seconds']:.3f} s")
    assert report["seconds"] < KERNEL_LOAD_LIMIT_S, report


def test_pdserve_colocated_starts_outside_the_checkout(installed: dict) -> None:
    pdserve = installed["root"] / "venv" / "bin" / "pdserve"
    log_path = installed["root"] / "colocated.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(pdserve), "colocated", "--port", "0", "--model", "tiny", "--num-blocks", "64",
             "--max-model-len", "256"],
            stdout=log, stderr=subprocess.STDOUT, cwd=installed["root"], env=installed["env"],
        )
    try:
        address = _wait_for_address(process, log_path, timeout_s=120)
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log = log_path.read_text()
    assert "paged decode kernel loaded (prebuilt at install" in log, log
    assert "unavailable" not in log, log


def _wait_for_address(process: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("colocated listening on "):  # printed once the model is loaded
                return line.split(" listening on ")[1].split()[0]
        if process.poll() is not None:
            pytest.fail(f"pdserve colocated exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    pytest.fail(f"pdserve colocated did not listen within {timeout_s} s:\n{log_path.read_text()}")
