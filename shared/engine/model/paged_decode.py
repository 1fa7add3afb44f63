"""Decode attention (one query token per sequence) read straight from the paged KV cache by a C++ kernel.

The kernel (csrc/paged_decode_*) is built at install time by setup.py, or else at first use (kernel_build.py);
when it can be neither loaded nor built, callers keep the SDPA path.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from shared.engine.model import kernel_build

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _kernel() -> Callable[..., torch.Tensor] | None:
    """Loads the extension (prebuilt at install, else built or found in the build folder) once per process;
    None if that fails."""
    try:
        origin = kernel_build.load_library()
        op = torch.ops.pdserve_paged_decode.paged_decode_attention
    except Exception as exc:  # no compiler or ninja, a build error, an unloadable library: all mean "use SDPA"
        logger.warning("paged decode kernel unavailable, decode attention keeps the SDPA path: %s",
                       _last_lines(str(exc)))
        return None
    logger.info("paged decode kernel loaded (%s; %s code path)", origin, torch.ops.pdserve_paged_decode.isa())
    return op


def _last_lines(text: str, count: int = 20) -> str:
    """Compiler errors are long; the tail holds the reason."""
    return "\n".join(text.strip().splitlines()[-count:])


def paged_decode_available(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> bool:
    """Whether paged_decode_attention can serve tensors of this dtype and device (builds the kernel once)."""
    return torch.device(device).type == "cpu" and dtype in _SUPPORTED_DTYPES and _kernel() is not None


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Softmax attention of each sequence's single query over its first context_lens[b] cached tokens.

    query [B, H, D]; key_cache / value_cache [num_blocks, block_size, KVH, D] with H a multiple of KVH
    (query head h reads kv head h // (H // KVH)); block_table [B, max_blocks] int64 or int32, token t of
    sequence b at block_table[b, t // block_size], offset t % block_size; context_lens [B], each in
    [1, max_blocks * block_size]. sliding_window: each query sees only its last sliding_window keys
    (itself included), as Mistral's and Qwen2's sliding-window layers do. Returns a new contiguous [B, H, D] tensor of query's dtype.
    Raises ValueError on malformed input, RuntimeError if the kernel is unavailable.
    """
    if query.device.type != "cpu":
        raise ValueError(f"paged_decode_attention runs on the CPU only, got query on {query.device}")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"paged_decode_attention supports float32 and bfloat16, got {query.dtype}")
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("paged decode kernel unavailable (see the earlier warning); check paged_decode_available()")
    return kernel(query, key_cache, value_cache, block_table, context_lens, float(scale), sliding_window)
