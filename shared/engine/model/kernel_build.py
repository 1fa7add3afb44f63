"""Where the paged decode kernel's library comes from: the extension setup.py builds at install time, or
else a build at first use in a folder of the project's own, keyed by the sources' hash and guarded by a
lock that a killed build cannot leave stuck."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# The TORCH_LIBRARY namespace in csrc/paged_decode_op.cpp, also the name of a build made at first use.
LIBRARY_NAME = "pdserve_paged_decode"
# The extension setup.py builds next to this file (shared/engine/model/_paged_decode_C*.so).
PREBUILT_MODULE = "_paged_decode_C"
CSRC = Path(__file__).parent / "csrc"
# Separate files so a build compiles the instruction-set copies of the kernel in parallel.
SOURCE_NAMES = ("paged_decode_op.cpp", "paged_decode_avx512.cpp", "paged_decode_avx2.cpp",
                "paged_decode_generic.cpp", "fused_ops.cpp")
# -O3 and OpenMP only. The sources build AVX-512, AVX2 and generic copies of the kernel and pick one at run
# time, so no -march flag ties a build to the CPU that compiled it. Without -fopenmp, at::parallel_for
# (inlined from torch's headers) would run serially; with it, it runs on torch's own OpenMP pool, since the
# extension's libgomp.so.1 resolves to the copy torch has already loaded.
CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
# A cold build takes about 35 s on 2 idle cores; a busy node may need several times that.
DEFAULT_BUILD_WAIT_S = 600.0
# The variable that moves the build folder (default: $XDG_CACHE_HOME/pdserve/kernels, else ~/.cache/...).
BUILD_ROOT_VARIABLE = "PDSERVE_KERNEL_DIR"
_OUR_LOCK = "pdserve.lock"
_TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton's file inside a build folder


class KernelBuildTimeout(TimeoutError):
    """Another process held the build folder's lock for longer than the wait allows."""


def source_hash() -> str:
    """Sources, flags, the torch and Python versions and torch's install folder: anything that changes the
    built library or its build files (two venvs sharing a cache would otherwise rebuild over each other,
    their build files naming different torch headers)."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2], str(Path(torch.__file__).parent))).encode())
    return digest.hexdigest()[:16]


def default_build_root() -> Path:
    explicit = os.environ.get(BUILD_ROOT_VARIABLE)
    if explicit:
        return Path(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "pdserve" / "kernels"


def prebuilt_library() -> Path | None:
    """The extension built at install time, if this installation has one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).parent / f"{PREBUILT_MODULE}{suffix}"
        if path.is_file():
            return path
    return None


@contextlib.contextmanager
def build_lock(folder: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive use of a build folder. The lock is an flock, which the kernel drops when its holder dies,
    so a killed build never blocks the next one. Every build into the folder takes it first, so a torch
    lock file found while holding it is a killed build's leftover: it is removed, or torch would wait on
    it forever."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / _OUR_LOCK, "a") as handle:
        _acquire(handle, folder, timeout_s)
        try:
            stale = folder / _TORCH_LOCK
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that was killed midway", stale)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(handle, folder: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise KernelBuildTimeout(
                    f"waited {timeout_s:.0f} s for another process building the paged decode kernel in "
                    f"{folder} (it holds {folder / _OUR_LOCK}); let it finish, or stop it and start again"
                ) from None
            time.sleep(0.1)


def build_here(build_root: Path, timeout_s: float = DEFAULT_BUILD_WAIT_S) -> Path:
    """Compiles the kernel (or finds the finished build) in build_root/<source hash> and loads it into
    torch.ops; returns the folder. Needs a C++ compiler and ninja."""
    from torch.utils import cpp_extension

    folder = build_root / source_hash()
    # Without this a first start is silent for about a minute while the compiler runs.
    logger.info("loading the paged decode kernel from %s (the first start builds it: about a minute)", folder)
    with build_lock(folder, timeout_s):
        sources = _sources_in(folder)
        cpp_extension.load(name=LIBRARY_NAME, sources=[str(sources / name) for name in SOURCE_NAMES],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(folder),
                           is_python_module=False, verbose=False)
    return folder


def _sources_in(folder: Path) -> Path:
    """The sources copied into the build folder: its build file names them by path, so a build from another
    checkout of the same sources (same hash, same folder) finds its own paths there and rebuilds nothing."""
    sources = folder / "src"
    sources.mkdir(parents=True, exist_ok=True)
    for path in CSRC.iterdir():
        if path.suffix in (".cpp", ".h") and not (sources / path.name).is_file():
            shutil.copyfile(path, sources / path.name)
    return sources


def load_library() -> str:
    """Loads the kernel into torch.ops, prebuilt if installed so, else built here; says which it was.
    Raises whatever stops both (no compiler, a build error, a lock held too long)."""
    import torch

    prebuilt = prebuilt_library()
    if prebuilt is not None:
        try:
            torch.ops.load_library(str(prebuilt))
            return f"prebuilt at install, {prebuilt.name}"
        except OSError as exc:  # built against another torch: build one that matches
            logger.warning("the prebuilt paged decode kernel %s does not load (%s); building it here", prebuilt, exc)
    folder = build_here(default_build_root())
    return f"built at first use in {folder}"
