"""The config.json fields that change a model's math, and which of their values the engine implements.

A checkpoint whose config asks for anything else is refused at load with an error naming the field:
running it anyway would give different tokens from transformers without a word.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "float", "bfloat16", "float16", "half")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class MathField:
    is_supported: Callable[[Any], bool]
    supported: str  # what the engine implements, for the error message


def _absent(value: Any) -> bool:
    """Unset, null, false or empty: the feature is off."""
    return not value


def _rope_type(params: Any) -> Any:
    if not isinstance(params, dict):
        return params
    return params.get("rope_type", params.get("type", "default"))


MATH_FIELDS: dict[str, MathField] = {
    "model_type": MathField(lambda v: v in SUPPORTED_MODEL_TYPES, f"one of {SUPPORTED_MODEL_TYPES}"),
    "hidden_act": MathField(lambda v: v == "silu", "silu"),
    "rope_scaling": MathField(lambda v: v is None or _rope_type(v) in SUPPORTED_ROPE_TYPES,
                              f"rope_type one of {SUPPORTED_ROPE_TYPES}"),
    "rope_parameters": MathField(lambda v: v is None or _rope_type(v) in SUPPORTED_ROPE_TYPES,
                                 f"rope_type one of {SUPPORTED_ROPE_TYPES}"),
    "partial_rotary_factor": MathField(lambda v: v is None or v == 1.0, "1.0 (rope on the whole head)"),
    "torch_dtype": MathField(lambda v: v is None or v in SUPPORTED_DTYPES, f"one of {SUPPORTED_DTYPES}"),
    "dtype": MathField(lambda v: v is None or v in SUPPORTED_DTYPES, f"one of {SUPPORTED_DTYPES}"),
    "layer_types": MathField(lambda v: v is None or all(t in SUPPORTED_LAYER_TYPES for t in v),
                             f"entries from {SUPPORTED_LAYER_TYPES}"),
    "quantization_config": MathField(_absent, "none (unquantized weights only)"),
    "compression_config": MathField(_absent, "none (unquantized weights only)"),
    "attn_logit_softcapping": MathField(_absent, "none"),
    "final_logit_softcapping": MathField(_absent, "none"),
    "use_qk_norm": MathField(_absent, "false (Qwen3's q_norm/k_norm come with model_type qwen3)"),
    "no_rope_layers": MathField(_absent, "none (rope on every layer)"),
    "dual_chunk_attention_config": MathField(_absent, "none"),
    "use_bidirectional_attention": MathField(_absent, "false (causal attention)"),
    "attention_multiplier": MathField(_absent, "none (scale head_dim ** -0.5)"),
    "embedding_multiplier": MathField(_absent, "none"),
    "residual_multiplier": MathField(_absent, "none"),
    "logits_scaling": MathField(_absent, "none"),
    "num_experts": MathField(_absent, "none (dense MLP only)"),
    "num_local_experts": MathField(_absent, "none (dense MLP only)"),
}


def check_fidelity(hf: dict[str, Any]) -> None:
    """Raises ValueError naming the first field of a config.json the engine would not honour exactly."""
    if "model_type" not in hf:
        raise ValueError("config.json has no model_type")
    for name, field in MATH_FIELDS.items():
        if name == "model_type" or name in hf:
            value = hf.get(name)
            if not field.is_supported(value):
                raise ValueError(f"unsupported {name} {value!r} in config.json: the engine implements "
                                 f"{field.supported} only")
