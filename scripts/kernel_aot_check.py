"""Compile the Triton attention kernels for a CUDA architecture on a machine without a GPU, and print
what each launch costs the GPU in registers, register spills and shared memory.

The kernels are compiled exactly as a launch on that GPU would compile them: triton_attention's own
launch functions run on CPU tensors of a preset's shapes, each kernel launch is recorded instead of
run, and the recorded arguments go through Triton's JIT specialization (alignment, constants) for
the target. ptxas (bundled with Triton) then reports the resources. A kernel that fails to compile
for the GPU, which the interpreter used by the CPU tests cannot show, fails here.

    python scripts/kernel_aot_check.py                       # every preset, float32 and bfloat16, sm_90
    python scripts/kernel_aot_check.py --preset llama3-8b --dtype bfloat16 --max-spill-bytes 0

Exit status: 0 when every kernel compiled (and spilled no more than --max-spill-bytes), else 1.
Triton's launch internals are used here (JITFunction's binder), checked against triton 3.6 and 3.9.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled for a GPU
    os.environ.pop("TRITON_INTERPRET")
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvidia_compiler  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from shared.engine.model import triton_attention  # noqa: E402
from shared.engine.model.model_config import PRESETS  # noqa: E402

KERNELS = ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")
BLOCK_SIZE = 16  # the serving profile's tokens per KV block
CONTEXT = 1024  # keys per decode row and prompt length: any length compiles the same kernels
WINDOW = 512  # a sliding-window variant (a constexpr, so another kernel) for checkpoints that have one


@dataclass
class Launch:
    kernel: str
    case: str
    args: tuple
    kwargs: dict


@dataclass
class Resources:
    preset: str
    dtype: str
    case: str
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    num_warps: int
    num_stages: int


class _Recorder:
    """Stands in for one kernel: `kernel[grid](*args, **kwargs)` records the launch instead."""

    def __init__(self, name: str, launches: list[Launch], case: list[str]):
        self.name, self._launches, self._case = name, launches, case

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launches.append(Launch(self.name, self._case[0], args, kwargs))


def record_launches(preset: str, dtype: torch.dtype) -> list[Launch]:
    """Every distinct kernel launch the engine makes for this preset's attention shapes."""
    config = PRESETS[preset]
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    num_blocks = CONTEXT // BLOCK_SIZE + 1
    cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    table = torch.arange(1, num_blocks, dtype=torch.long).unsqueeze(0)
    lens = torch.tensor([CONTEXT], dtype=torch.long)
    decode_query = torch.zeros(1, heads, head_dim, dtype=dtype)
    prompt_query = torch.zeros(CONTEXT, heads, head_dim, dtype=dtype)
    span = type("Span", (), {"query_start": 0, "query_len": CONTEXT, "context_len": CONTEXT,
                             "block_ids": table[0]})()
    launches: list[Launch] = []
    case = [""]
    originals = {name: getattr(triton_attention, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(triton_attention, name, _Recorder(name, launches, case))
        for window in (None, WINDOW):
            suffix = "" if window is None else f", window {window}"
            for splits in (1, 8):
                case[0] = f"decode, {splits} split{'s' if splits > 1 else ''}{suffix}"
                triton_attention.decode_attention(decode_query, cache, cache, table, lens, 0.1, window,
                                                  num_splits=splits)
            case[0] = f"prefill{suffix}"
            batch = triton_attention.span_batch([span], torch.device("cpu"), triton_attention.prefill_tile(dtype))
            triton_attention.prefill_attention(prompt_query, cache, cache, batch, 0.1, window)
    finally:
        for name, kernel in originals.items():
            setattr(triton_attention, name, kernel)
    return launches


def compile_launch(launch: Launch, target: GPUTarget):
    """Compile as JITFunction.run would on a GPU of this target (same specialization and options)."""
    kernel = getattr(triton_attention, launch.kernel)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args,
                                                              specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) that ptxas reports for the kernel."""
    ptxas = nvidia_compiler.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                               str(source), "-o", str(Path(scratch) / "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas output: {done.stderr}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def check(presets: list[str], dtypes: list[str], arch: int) -> list[Resources]:
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for preset in presets:
        for dtype in dtypes:
            for launch in record_launches(preset, getattr(torch, dtype)):
                compiled = compile_launch(launch, target)
                registers, spill_stores, spill_loads = ptxas_report(compiled.asm["ptx"], arch)
                rows.append(Resources(preset, dtype, launch.case, launch.kernel.strip("_"), registers,
                                      spill_stores, spill_loads, compiled.metadata.shared,
                                      compiled.metadata.num_warps, compiled.metadata.num_stages))
                print(_format(rows[-1]), flush=True)
    return rows


def _format(row: Resources) -> str:
    return (f"{row.preset:10} {row.dtype:9} {row.case:30} {row.kernel:20} regs {row.registers:3}  "
            f"spill {row.spill_store_bytes:5}/{row.spill_load_bytes:<5} B  smem {row.shared_bytes:6} B  "
            f"warps {row.num_warps} stages {row.num_stages}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default: all")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"),
                        help="repeatable; default: both")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--max-spill-bytes", type=int, default=None,
                        help="fail when a kernel spills more register bytes than this")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_{args.arch}, ptxas {nvidia_compiler.get_ptxas(args.arch).version}")
    rows = check(args.preset or sorted(PRESETS), args.dtype or ["float32", "bfloat16"], args.arch)
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    if args.max_spill_bytes is not None:
        over = [row for row in rows if row.spill_store_bytes > args.max_spill_bytes]
        for row in over:
            print(f"SPILLS: {_format(row)}", file=sys.stderr)
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
