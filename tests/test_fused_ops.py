"""The decoder's fused elementwise ops give the torch chains' bits (transformers' order) at widths whose
rows end in a partial vector, in both dtypes; where the library is built they are the path taken."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine.model import fused_ops
from shared.engine.model.paged_decode import paged_decode_available

pytestmark = pytest.mark.slow
DTYPES = (torch.float32, torch.bfloat16)


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * torch.rand(rows, 1, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 97, 2816])
def test_silu_mul_equals_silu_then_mul(dtype, width):
    gate_up = _rows(45, 2 * width, dtype, width, scale=12.0)
    gate_up[0, :width] = torch.linspace(-120, 120, width)  # where exp over- and underflows
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate) * up
    assert torch.equal(fused_ops.silu_mul(gate_up, width), expected)
    if paged_decode_available():
        assert fused_ops._silu_mul_checked(width, dtype)  # the fused op is what ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100])
def test_add_rms_norm_equals_add_then_norm(dtype, width):
    residual, delta = _rows(33, width, dtype, 1), _rows(33, width, dtype, 2)
    weight = _rows(1, width, dtype, 3)[0]
    expected_sum = residual + delta
    expected = fused_ops.rms_norm_reference(expected_sum, weight, 1e-5)
    total, normed = fused_ops.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    assert torch.equal(total, expected_sum) and torch.equal(normed, expected)
    if paged_decode_available():
        assert fused_ops._norm_checked(width, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_equals_apply_rope(dtype):
    x = _rows(21 * 7, 64, dtype, 4).view(21, 7, 64)
    cos, sin = (_rows(21, 64, dtype, seed).view(21, 1, 64) for seed in (5, 6))
    expected = fused_ops.apply_rope(x, cos, sin)
    assert torch.equal(fused_ops.rotate(x.clone(), cos, sin), expected)
    if paged_decode_available():
        assert fused_ops._rope_checked(64, dtype)
