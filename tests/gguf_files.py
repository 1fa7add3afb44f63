"""Writing small GGUF checkpoints for the tests with gguf's own writer: a random model of ours, its
tensors in a chosen tensor type, Llama's q/k rows permuted as llama.cpp's converter permutes them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, quants

from shared.engine.model.loader import random_model, to_hf_state_dict
from shared.engine.model.model_config import ModelArchConfig

# The tensor types whose blocks gguf can quantize; for the others (the K-quants) gguf only dequantizes,
# so their blocks are random bytes with scales set to a sane size (offsets of the float16 scales: d, dmin).
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")
K_QUANT_SCALES = {"Q2_K": ((80, 2e-3), (82, 2e-3)), "Q3_K": ((108, 1e-4),), "Q4_K": ((0, 5e-5), (2, 5e-5)),
                  "Q5_K": ((0, 3e-5), (2, 3e-5)), "Q6_K": ((208, 5e-6),)}
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (its rope pairs adjacent dimensions)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encoded(values: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    """values (float32, a matrix) in type_name: the array GGUFWriter takes and its raw type."""
    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values, qtype
    if type_name == "F16":
        return values.astype(np.float16), qtype
    if type_name in QUANTIZABLE:
        return quants.quantize(values, qtype), qtype
    block_values, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset, scale in K_QUANT_SCALES[type_name]:
        scales = (scale * rng.uniform(0.5, 1.5, size=blocks.shape[:2])).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1), qtype


def write_gguf(path: Path, config: ModelArchConfig, type_of: dict[str, str] | str, seed: int = 7,
               extra_metadata: dict | None = None) -> Path:
    """A GGUF of random_model(config, seed), matrices in type_of (one type, or one per GGUF tensor name
    with "*" for the rest); norms stay F32, as llama.cpp keeps them."""
    arch = config.model_type
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"random {arch}")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for key, value in (extra_metadata or {}).items():
        writer.add_key_value(key, *value)
    for hf_name, tensor in to_hf_state_dict(random_model(config, seed)).items():
        name, values = gguf_name(hf_name), tensor.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            values = llama_cpp_permute(values, config.num_heads if ".attn_q." in name else config.num_kv_heads)
        kind = type_of if isinstance(type_of, str) else type_of.get(name, type_of["*"])
        if values.ndim == 1:
            kind = "F32"
        data, qtype = encoded(values, kind, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
