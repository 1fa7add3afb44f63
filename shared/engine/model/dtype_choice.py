"""--dtype auto (torch-free, for the launcher too): the dtype a model runs in, and the reason (logged at start-up). On the CPU bfloat16 pays
only with native bfloat16 matmuls (AVX512-BF16 or AMX) and a checkpoint that is not float32 to begin with."""
from __future__ import annotations

from pathlib import Path

DTYPE_AUTO = "auto"
DTYPE_CHOICES = (DTYPE_AUTO, "float32", "bfloat16")
CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
NARROW_CHECKPOINTS = ("bfloat16", "float16", "quantized")


def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The bfloat16 matmul features this CPU reports (empty where it reports none, or cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in flags)


def auto_dtype(checkpoint_dtype: str, device: object,
               bf16_flags: tuple[str, ...] | None = None) -> tuple[str, str]:
    """(dtype, reason). checkpoint_dtype: float32, bfloat16, float16, or quantized (a GGUF's weights)."""
    if str(device).startswith("cuda"):
        dtype = "float32" if checkpoint_dtype in ("float32", "float16") else "bfloat16"
        return dtype, f"the checkpoint is {checkpoint_dtype}, on a GPU"
    flags = cpu_bf16_flags() if bf16_flags is None else bf16_flags
    if checkpoint_dtype not in NARROW_CHECKPOINTS:
        return "float32", f"the checkpoint is {checkpoint_dtype}"
    if not flags:
        return "float32", f"the checkpoint is {checkpoint_dtype} but the CPU has no AVX512-BF16 or AMX"
    return "bfloat16", f"the checkpoint is {checkpoint_dtype} and the CPU has {', '.join(flags)}"
