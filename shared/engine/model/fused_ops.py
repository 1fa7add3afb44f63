"""The decoder's elementwise steps, residual add + RMSNorm, rotary embedding and SiLU-and-multiply, each
as one C++ pass (csrc/fused_ops.cpp) on the CPU, else as torch op chains; both give the same bits
(transformers' order).

In bfloat16 the torch chains cost more than the matmuls around them at decode batch sizes: a norm is
seven ops over the rows, each converting to float32 and back. The fused ops run only once a check on
this machine proved them bit-identical to the chains for that width and dtype (they copy the order of
torch's own float32 sum, which a different torch could change).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from shared.engine.model.paged_decode import paged_decode_available

logger = logging.getLogger(__name__)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32 whatever the storage dtype, round, then scale."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), without building rotate_half:
    the same products and sums in the same order (a + (-b) is a - b exactly), so bit-identical to
    transformers, with two fewer activation-sized temporaries."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, its RMSNorm). The fused path adds delta into residual in place (the caller's
    residual is a tensor of its own); the torch path makes a new sum."""
    if _fused_fits(residual, delta) and _norm_checked(residual.shape[-1], residual.dtype):
        return residual, torch.ops.pdserve_fused.add_rms_norm(residual, delta, weight, eps)
    if delta is not None:
        residual = residual + delta
    return residual, rms_norm_reference(residual, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(x [T, heads, D], cos/sin [T, 1, D]); the fused path rotates x in place and returns it."""
    if _fused_fits(x) and x.stride(-1) == 1 and _rope_checked(x.shape[-1], x.dtype):
        torch.ops.pdserve_fused.rope_(x, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
        return x
    return apply_rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (the MLP's fused projection), as a new contiguous tensor."""
    if _fused_fits(gate_up) and gate_up.dim() == 2 and _silu_mul_checked(width, gate_up.dtype):
        return torch.ops.pdserve_fused.silu_mul(gate_up, width)
    gate, up = gate_up.split(width, dim=-1)
    # gate is a strided half of gate_up: silu writes a new contiguous tensor, which the down
    # projection's matmul then takes as is (an in-place silu kept the stride and cost a copy there).
    return F.silu(gate).mul_(up)


def _fused_fits(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)
                             and t.stride(-1) == 1) for t in tensors)


@functools.cache
def _library_loaded() -> bool:
    return paged_decode_available() and hasattr(torch.ops.pdserve_fused, "silu_mul")


@functools.cache
def _norm_checked(hidden: int, dtype: torch.dtype) -> bool:
    """Whether the fused norm gives the torch chain's bits on random rows of this width and dtype here."""
    if not _library_loaded():
        return False
    gen = torch.Generator().manual_seed(hidden)
    rows = 67
    x = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    expected_sum = x + delta
    expected = rms_norm_reference(expected_sum, weight, 1e-6)
    with torch.inference_mode():
        fused = torch.ops.pdserve_fused.add_rms_norm(x, delta, weight, 1e-6)
    same = torch.equal(fused, expected) and torch.equal(x, expected_sum)
    if not same:
        logger.warning("fused RMSNorm differs from torch's (width %d, %s): keeping the torch ops", hidden, dtype)
    return same


@functools.cache
def _rope_checked(head_dim: int, dtype: torch.dtype) -> bool:
    if not _library_loaded() or head_dim % 2:
        return False
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(29, 5, head_dim, generator=gen).to(dtype)
    cos, sin = (torch.randn(29, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    expected = apply_rope(x, cos, sin)
    with torch.inference_mode():
        torch.ops.pdserve_fused.rope_(x, cos.view(29, -1), sin.view(29, -1))
    same = torch.equal(x, expected)
    if not same:
        logger.warning("fused rotary embedding differs from torch's (head_dim %d, %s): keeping the torch ops",
                       head_dim, dtype)
    return same


@functools.cache
def _silu_mul_checked(width: int, dtype: torch.dtype) -> bool:
    """Whether the fused op gives torch's bits here: its exp must be the one torch's silu runs on this CPU."""
    if not _library_loaded():
        return False
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(37, 2 * width, generator=gen) * 6).to(dtype)
    gate_up[0, :width] = torch.linspace(-100, 100, width)  # exp's overflow and underflow ends
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate).mul_(up)
    with torch.inference_mode():
        fused = torch.ops.pdserve_fused.silu_mul(gate_up, width)
    same = torch.equal(fused, expected)
    if not same:
        logger.warning("fused SiLU-and-multiply differs from torch's (width %d, %s): keeping the torch ops",
                       width, dtype)
    return same
