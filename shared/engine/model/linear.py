"""Linear layers whose CPU matmuls (float32 and bfloat16) run through oneDNN on prepacked weights.

On the AMD EPYC (Zen 4) machines this project is measured on, MKL's sgemm takes a slower code path
than on Intel parts: oneDNN's matmul ran 15-25% faster on the model's prefill shapes and 1.7x on the
decode-time LM head ([64, 768] x [768, 32000]: 165 vs 98 GFLOP/s), and weights reordered once into
its blocked layout (pack_weight) gain another 10-20%, since the reorder otherwise happens inside
every call. bfloat16's F.linear already calls oneDNN (its brgemm matmul with the weight as stored);
prepacked, the same AVX512-BF16 kernels skip that per-call work, with bit-identical results (the
products and their float32 sums in the same order). Everything else (CUDA, a CPU without bfloat16
matmul support, an unpacked layer, a torch built without oneDNN) keeps torch's own F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


_ONEDNN_LINEAR = _onednn_linear_available()


def _packable(weight: torch.Tensor) -> bool:
    if not _ONEDNN_LINEAR or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout for linear(), or None where oneDNN does not apply."""
    if not _packable(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, as F.linear computes it; packed_weight: pack_weight(weight), if made."""
    if packed_weight is not None and x.dtype == weight.dtype and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward uses linear() above.

    pack() keeps a oneDNN-layout copy of the weight beside it (the dense weight stays: loaders,
    savers and other devices use it), so a packed layer holds its weight twice."""

    packed_weight: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """No initialisation: the model is built on "meta" and the loader overwrites every weight. (nn.Linear's
        random init on a meta tensor goes through torch's reference ops, which import torch._dynamo: about
        2 s of every process start.)"""

    def pack(self) -> None:
        """Call after the weights are final and on their device; a later weight change needs pack() again."""
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)
