"""Rewrite a nixl-cu12/cu13 wheel with only what the UCX backend needs, so it fits the GPU run's tree limit.

The published wheel (nixl-cu13 1.5.1: 59 MB, 238 MB unpacked) carries every NIXL plugin (GDS, S3,
Azure, libfabric, GPUNETIO, ...), the NIXL EP extension built for three torch versions, UCX's
InfiniBand and perftest modules and example programs. pdserve uses the Python API with the UCX
backend alone (shared/engine/kv_transfer/transfer_agent.py), between processes on one machine: UCX's
cma (host memory) and cuda_ipc/cuda_copy (device memory) transports.

Kept: every file of the Python package, the UCX backend plugin, UCX's cuda and cma modules, and every
shared library those load (their ELF NEEDED entries, followed transitively, matched by file name
inside the wheel). Dropped: everything else. RECORD is regenerated, so pip installs the result as
usual. Needs `readelf` (binutils).

    python scripts/slim_nixl_wheel.py IN.whl OUT.whl
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import posixpath
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Shared objects that are loaded with dlopen rather than linked: NIXL's backend plugin (NIXL scans a
# plugin folder beside libnixl.so; the wheel has two copies of that folder, both keep UCX only) and
# the UCX transport modules (UCX scans the ucx/ folder beside libucs).
DLOPENED_ROOTS = (
    "plugins/libplugin_UCX.so",
    "nixl/libplugin_UCX.so",
    "ucx/libuct_cuda.",
    "ucx/libucm_cuda.",
    "ucx/libuct_cma.",
)


def _is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def _needed(path: Path) -> list[str]:
    output = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    return [line.rsplit("[", 1)[1].rstrip("]") for line in output.splitlines() if "(NEEDED)" in line]


def _python_package(names: list[str]) -> str:
    """The import package's folder (nixl_cu13/): the one holding __init__.py at the top level."""
    for name in names:
        parts = name.split("/")
        if len(parts) == 2 and parts[1] == "__init__.py" and not parts[0].startswith("nixl_ep"):
            return parts[0]
    raise SystemExit("no top-level package with __init__.py in the wheel")


def _kept_files(unpacked: Path, names: list[str]) -> set[str]:
    package = _python_package(names)
    dist_info = next(name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info"))
    elf_names = {name for name in names if _is_elf((unpacked / name).read_bytes()[:4])}
    by_basename: dict[str, list[str]] = {}
    for name in elf_names:
        by_basename.setdefault(posixpath.basename(name), []).append(name)
    roots = [name for name in elf_names if name.startswith(package + "/")]
    roots += [name for name in elf_names if any(root in name for root in DLOPENED_ROOTS)]
    kept_elves: set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in kept_elves:
            continue
        kept_elves.add(name)
        for needed in _needed(unpacked / name):
            pending.extend(by_basename.get(needed, []))  # not in the wheel: a system library (libc, libcuda)
    plain = {name for name in names if name not in elf_names and name.split("/")[0] in (package, dist_info)}
    # libtool's .la files beside the kept UCX modules (UCX reads them when present).
    modules = {name[: -len(".so.0.0.0")] + ".la" for name in kept_elves if name.endswith(".so.0.0.0")}
    return plain | kept_elves | (modules & set(names))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(source: Path, target: Path) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(source) as wheel:
        unpacked = Path(scratch)
        wheel.extractall(unpacked)
        names = [info.filename for info in wheel.infolist() if not info.is_dir()]
        kept = _kept_files(unpacked, names)
        record_name = next(name for name in names if name.endswith(".dist-info/RECORD"))
        lines = []
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for name in sorted(kept - {record_name}):
                info = wheel.getinfo(name)
                data = (unpacked / name).read_bytes()
                out.writestr(info, data, zipfile.ZIP_DEFLATED, 9)  # keeps the file mode (executable .so)
                lines.append(_record_line(name, data))
            lines.append(f"{record_name},,")
            out.writestr(record_name, "\n".join(lines) + "\n")
    return len(names), len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.source.resolve() == args.target.resolve():
        sys.exit("write the slim wheel to another path")
    num_files, num_kept = slim(args.source, args.target)
    print(f"{args.target.name}: kept {num_kept} of {num_files} files, "
          f"{args.source.stat().st_size / 2**20:.1f} MiB -> {args.target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
