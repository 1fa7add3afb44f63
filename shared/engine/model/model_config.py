"""Model architecture config (Llama, Mistral, Qwen2) parsed from a Hugging Face config.json, plus presets.

The presets ("tiny", "100m") are the built-in random-weight models; "tiny" is the default.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_PRESET = "tiny"

# model_type -> the transformers class name written into config.json "architectures"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the forward pass needs to know about the network's shape and numerics."""

    model_type: str = "llama"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    dtype: str = "float32"
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type == "qwen2":
            object.__setattr__(self, "attention_bias", True)  # Qwen2 always has q/k/v biases
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def with_dtype(self, dtype: str) -> "ModelArchConfig":
        return dataclasses.replace(self, dtype=dtype)

    # ---- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "custom", dtype: str | None = None) -> "ModelArchConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {SUPPORTED_MODEL_TYPES})")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r} (only silu)")
        rope_theta, rope_scaling = _parse_rope(hf)
        max_positions = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        if hf.get("use_sliding_window", model_type == "mistral") and window:
            # Attention here is always full; within the window that is exactly sliding-window attention,
            # so sequences are capped at the window instead of silently diverging past it.
            max_positions = min(max_positions, int(window))
        if dtype is None:
            dtype = _parse_dtype(hf.get("torch_dtype") or hf.get("dtype"))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases; Llama and Mistral only when attention_bias says so.
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            dtype=dtype,
            name=name,
        )

    @classmethod
    def from_json_file(cls, path: str | Path, dtype: str | None = None) -> "ModelArchConfig":
        path = Path(path)
        with path.open() as f:
            return cls.from_hf_dict(json.load(f), name=path.parent.name, dtype=dtype)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (v4 and v5) reads back into the same architecture."""
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "torch_dtype": self.dtype,
            "attention_dropout": 0.0,
        }
        if self.model_type in ("llama", "mistral"):
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.model_type in ("mistral", "qwen2"):
            hf["sliding_window"] = None
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = False
        return hf


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers v5 folds theta and scaling into "rope_parameters"; v4 files keep them apart.
    params = hf.get("rope_parameters")
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in ("llama3", "linear", "default"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
        if rope_type == "default":
            scaling = None
    return theta, scaling


def _parse_dtype(value: Any) -> str:
    if value in (None, "float32", "float"):
        return "float32"
    if value == "bfloat16":
        return "bfloat16"
    # float16 checkpoints run in float32 here: CPU half matmuls are slow and lossy.
    if value in ("float16", "half"):
        return "float32"
    raise ValueError(f"unsupported dtype {value!r} in config.json (supported: float32, bfloat16)")


PRESETS: dict[str, ModelArchConfig] = {
    "tiny": ModelArchConfig(
        name="tiny", vocab_size=4096, hidden_size=256, intermediate_size=768,
        num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=2048,
    ),
    "100m": ModelArchConfig(
        name="100m", vocab_size=32000, hidden_size=768, intermediate_size=2048,
        num_layers=12, num_heads=12, num_kv_heads=4, max_position_embeddings=2048,
    ),
}


def preset(name: str, dtype: str = "float32") -> ModelArchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown built-in model {name!r} (choose from {sorted(PRESETS)})")
    return PRESETS[name].with_dtype(dtype)
