"""A GGUF checkpoint's tensors dequantized by the gguf package (ggml's own reader) into torch tensors under
their Hugging Face names, with llama.cpp's rotary permutation of Llama's q and k rows undone."""
from __future__ import annotations

import re

import numpy as np
import torch

from shared.engine.model.gguf_metadata import GgufMetadata

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp writes that the engine has no place for, and what they mean.
_UNSUPPORTED_TENSORS = {"rope_freqs.weight": "per-frequency rope factors (Llama 3.1 style rope scaling)"}


def hf_tensor_name(gguf_name: str) -> str:
    """model.layers.N.self_attn.q_proj.weight for blk.N.attn_q.weight; ValueError for a tensor the engine's
    model has no place for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    meaning = _UNSUPPORTED_TENSORS.get(gguf_name, "not part of the architectures the engine implements")
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} ({meaning})")


def read_gguf_weights(metadata: GgufMetadata, num_heads: int, num_kv_heads: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the file by Hugging Face name, dequantized to float32 and cast to dtype."""
    from gguf.quants import dequantize

    metadata.check_tensor_types()
    # llama.cpp's converter interleaves the rotary halves of Llama's q and k rows (its rope pairs adjacent
    # dimensions); Qwen's files keep transformers' order.
    permuted = metadata.architecture == "llama"
    weights = {}
    for tensor in metadata.reader.tensors:
        name = hf_tensor_name(tensor.name)
        values = dequantize(tensor.data, tensor.tensor_type)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            values = _unpermute_rotary(values, num_heads if ".q_proj." in name else num_kv_heads)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    return weights


def _unpermute_rotary(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's permute: per head, rows (half, pair) -> (pair, half)."""
    half = values.shape[0] // num_heads // 2
    grouped = values.reshape(num_heads, half, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)
