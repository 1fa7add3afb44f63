"""Model architecture config (Llama, Mistral, Qwen2, Qwen3) parsed from a Hugging Face config.json, plus presets.

The presets ("tiny", "100m", "llama3-8b") are the built-in random-weight models; "tiny" is the default.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.engine.model.checkpoint_json import check_field_types, read_json_object
from shared.engine.model.fidelity import SUPPORTED_MODEL_TYPES, check_fidelity
from shared.engine.model.generation_config import eos_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_PRESET = "tiny"

# model_type -> the transformers class name written into config.json "architectures"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# transformers' sliding_window when config.json leaves it out (LlamaConfig has no such field).
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096}
# Qwen2/Qwen3 slide only with use_sliding_window, and then (without layer_types) the layers from
# max_window_layers on; Llama and Mistral slide every layer when they have a window.
_USE_SLIDING_WINDOW_TYPES = ("qwen2", "qwen3")
_DEFAULT_MAX_WINDOW_LAYERS = 28

# The JSON types of the config.json fields the engine reads ("null": transformers' default applies). A
# value of another type is refused by name: tie_word_embeddings "false" would otherwise read as true.
CONFIG_FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "model_type": ("string",),
    "hidden_act": ("string",),
    "torch_dtype": ("string", "null"),
    "dtype": ("string", "null"),
    "vocab_size": ("integer",),
    "hidden_size": ("integer",),
    "intermediate_size": ("integer",),
    "num_hidden_layers": ("integer",),
    "num_attention_heads": ("integer",),
    "num_key_value_heads": ("integer", "null"),
    "head_dim": ("integer", "null"),
    "max_position_embeddings": ("integer",),
    "rms_norm_eps": ("number",),
    "rope_theta": ("number",),
    "rope_scaling": ("object", "null"),
    "rope_parameters": ("object", "null"),
    "partial_rotary_factor": ("number", "null"),
    "tie_word_embeddings": ("boolean",),
    "attention_bias": ("boolean",),
    "mlp_bias": ("boolean",),
    "use_sliding_window": ("boolean",),
    "sliding_window": ("integer", "null"),
    "max_window_layers": ("integer",),
    "layer_types": ("array", "null"),
    "bos_token_id": ("integer", "null"),
    "eos_token_id": ("integer", "array", "null"),
}
# Fields without a default the engine could trust: the weights' shapes follow from them.
_REQUIRED_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")


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
    attention_bias: bool = False  # biases on q, k and v (and on o for Llama and Qwen3); Qwen2 always has them
    mlp_bias: bool = False  # biases on gate, up and down (Llama only)
    sliding_window: int | None = None  # keys a query sees on sliding layers, itself included
    layer_types: tuple[str, ...] | None = None  # per layer FULL_ATTENTION or SLIDING_ATTENTION; None: derived
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
        if self.model_type == "mistral":
            object.__setattr__(self, "attention_bias", False)  # Mistral never has biases
        if self.mlp_bias and self.model_type != "llama":
            raise ValueError(f"mlp_bias is a Llama option; {self.model_type} has no MLP biases")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_sliding_window()

    def _check_sliding_window(self) -> None:
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.layer_types is None:
            kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for kind in self.layer_types:
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(f"unsupported layer type {kind!r} (supported: {FULL_ATTENTION}, {SLIDING_ATTENTION})")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.model_type == "llama" and SLIDING_ATTENTION in self.layer_types:
            # transformers' Llama attention has no window, yet its generate() cache keeps only the last
            # sliding_window keys of such layers: prefill sees every key, decode the window. No attention
            # gives its tokens, so the checkpoint is refused rather than run differently.
            raise ValueError(f"sliding_window {self.sliding_window} with sliding_attention layers (layer_types "
                             f"{list(self.layer_types)}) is not supported for model_type llama: transformers' "
                             f"Llama attends to every key on prefill but only the window on decode")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of that layer's attention, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def has_sliding_window(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    @property
    def o_proj_bias(self) -> bool:
        # Llama and Qwen3 put attention_bias on the output projection too; Qwen2 only on q, k and v.
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over head_dim on every query and key head, before rope."""
        return self.model_type == "qwen3"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    def with_dtype(self, dtype: str) -> "ModelArchConfig":
        return dataclasses.replace(self, dtype=dtype)

    # ---- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "custom", dtype: str | None = None) -> "ModelArchConfig":
        """dtype: "float32" or "bfloat16"; None takes the checkpoint's own (float16 runs as float32)."""
        check_field_types(hf, CONFIG_FIELD_TYPES, "config.json")
        missing = [name for name in _REQUIRED_FIELDS if name not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)}")
        check_fidelity(hf)
        model_type = hf["model_type"]
        rope_theta, rope_scaling = _parse_rope(hf)
        if dtype is None:
            dtype = _parse_dtype(hf.get("torch_dtype") or hf.get("dtype"))
        sliding_window, layer_types = _parse_sliding_window(hf)
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
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 always carries q/k/v biases and Mistral never; Llama and Qwen3 when attention_bias says so.
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False) and model_type == "llama",
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            dtype=dtype,
            name=name,
        )

    @classmethod
    def from_json_file(cls, path: str | Path, dtype: str | None = None) -> "ModelArchConfig":
        path = Path(path)
        return cls.from_hf_dict(read_json_object(path), name=path.parent.name, dtype=dtype)

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
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
            if len(set(self.layer_types)) > 1:
                hf["layer_types"] = list(self.layer_types)  # transformers then reads it as Ministral: per layer
        if self.model_type in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = self.sliding_window is not None
            hf["sliding_window"] = self.sliding_window
            hf["max_window_layers"] = self.num_layers
            hf["layer_types"] = list(self.layer_types)
        return hf


def _parse_sliding_window(hf: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types) as transformers computes them, one rule for every model type: a layer slides
    when its layer_types entry is sliding_attention. Without layer_types transformers derives the entries:
    Qwen2/Qwen3 slide the layers from max_window_layers on, the others every layer, and only where there is
    a window (sliding_window, which Qwen2/Qwen3 drop without use_sliding_window). Combinations transformers
    crashes on are refused here; Llama's sliding layers, which it runs inconsistently, by ModelArchConfig."""
    model_type, num_layers = hf["model_type"], hf["num_hidden_layers"]
    window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type))
    if model_type in _USE_SLIDING_WINDOW_TYPES and not hf.get("use_sliding_window", False):
        window = None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_sliding = hf.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS) \
            if model_type in _USE_SLIDING_WINDOW_TYPES else 0
        layer_types = [SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                       for i in range(num_layers)]
    if SLIDING_ATTENTION in layer_types and window is None:
        off = ("use_sliding_window is false" if model_type in _USE_SLIDING_WINDOW_TYPES
               and not hf.get("use_sliding_window", False) else "sliding_window is absent or null")
        raise ValueError(f"layer_types has sliding_attention layers but {off}: transformers has no window "
                         f"for them (and fails on this config)")
    if model_type == "mistral" and "layer_types" in hf and window is None:
        # transformers reads a Mistral config with layer_types as Ministral, whose masks need a window.
        raise ValueError("a mistral config.json with layer_types needs a sliding_window (transformers, reading "
                         "it as Ministral, fails without one)")
    if SLIDING_ATTENTION not in layer_types:
        window = None  # no layer uses it (transformers' Llama attention, for one, never does)
    return window, tuple(layer_types)


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
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
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
    # Llama-3.1-8B's shapes, rope and token ids (its config.json), for GPU benchmarks; bfloat16 like the
    # checkpoint. A serving max_model_len can be smaller than its positions.
    "llama3-8b": ModelArchConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
    ),
}

# Presets too big to draw on the CPU (8 billion values) or to ship a tokenizer for: the loader draws
# their weights on the target device (so they differ between devices), and they take token ids only.
LARGE_PRESETS = frozenset({"llama3-8b"})


def preset(name: str, dtype: str | None = None) -> ModelArchConfig:
    """dtype: None keeps the preset's own (float32, bfloat16 for llama3-8b)."""
    if name not in PRESETS:
        raise ValueError(f"unknown built-in model {name!r} (choose from {sorted(PRESETS)})")
    return PRESETS[name] if dtype is None else PRESETS[name].with_dtype(dtype)
