"""shared.engine.model.kernel_build: a build killed midway never blocks the next start (its lock file is
removed, its flock died with it), a build that takes too long ends the wait with a clear message, and the
build folder is keyed by the sources' hash."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.engine.model import kernel_build

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e  # lock holders and a kernel build run as processes

HOLD_SCRIPT = """
import fcntl, sys, time
handle = open(sys.argv[1], "a")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def _hold_lock(folder: Path) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(folder / "pdserve.lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.timeout(30)
def test_a_stale_torch_lock_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with kernel_build.build_lock(tmp_path, timeout_s=5):
        assert not (tmp_path / "lock").exists()


@pytest.mark.timeout(30)
def test_a_lock_held_too_long_times_out_with_a_clear_message(tmp_path: Path) -> None:
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(kernel_build.KernelBuildTimeout, match="another process building the paged decode kernel"):
            with kernel_build.build_lock(tmp_path, timeout_s=0.5):
                pass
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(30)
def test_a_killed_holder_does_not_block_the_next_build(tmp_path: Path) -> None:
    holder = _hold_lock(tmp_path)
    (tmp_path / "lock").write_text("")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with kernel_build.build_lock(tmp_path, timeout_s=5):
        assert not (tmp_path / "lock").exists()


def test_the_build_folder_is_keyed_by_the_sources() -> None:
    digest = kernel_build.source_hash()
    assert len(digest) == 16 and digest == kernel_build.source_hash()
    assert all((kernel_build.CSRC / name).is_file() for name in kernel_build.SOURCE_NAMES)


@pytest.mark.timeout(300)
def test_a_start_after_a_killed_build_loads_the_kernel(tmp_path: Path) -> None:
    """End to end, in a fresh interpreter: a build folder with a killed build's lock file still loads."""
    warm = kernel_build.default_build_root() / kernel_build.source_hash()
    if (warm / f"{kernel_build.LIBRARY_NAME}.so").is_file():  # reuse the finished build: ninja finds it current
        shutil.copytree(warm, tmp_path / kernel_build.source_hash(), ignore=shutil.ignore_patterns("*.lock"))
    (tmp_path / kernel_build.source_hash()).mkdir(exist_ok=True)
    (tmp_path / kernel_build.source_hash() / "lock").write_text("")
    script = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from shared.engine.model import kernel_build
        kernel_build.build_here(Path({str(tmp_path)!r}), timeout_s=240)
        print(torch.ops.pdserve_paged_decode.isa())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    assert not (tmp_path / kernel_build.source_hash() / "lock").exists()


@pytest.mark.timeout(300)
def test_another_checkout_of_the_same_sources_finds_the_finished_build(tmp_path: Path) -> None:
    """The build folder is keyed by the sources' hash, and the build compiles copies inside it: a process
    started from a checkout elsewhere, with the same sources, recompiles nothing (pods of several checkouts
    share the folder)."""
    root = tmp_path / "kernels"
    other = tmp_path / "other-checkout"
    shutil.copytree(kernel_build.CSRC, other)

    def build_from(sources: Path) -> None:
        script = textwrap.dedent(f"""
            from pathlib import Path
            from shared.engine.model import kernel_build
            kernel_build.CSRC = Path({str(sources)!r})
            kernel_build.build_here(Path({str(root)!r}), timeout_s=240)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280, cwd=REPO)
        assert result.returncode == 0, result.stderr[-3000:]

    build_from(kernel_build.CSRC)
    folder = root / kernel_build.source_hash()
    built = {path.name: path.stat().st_mtime_ns for path in folder.iterdir() if path.suffix in (".o", ".so")}
    assert f"{kernel_build.LIBRARY_NAME}.so" in built
    build_from(other)
    assert {name: (folder / name).stat().st_mtime_ns for name in built} == built
