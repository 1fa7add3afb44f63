"""A GGUF checkpoint's metadata (llama.cpp's single-file format): where the file is, the config.json it
amounts to, and the refusals, by name, of what the engine does not implement. Torch-free: the router
reads a GGUF's tokenizer through here too."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
# general.architecture values the engine runs. llama.cpp writes Mistral's models as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Tensor types the gguf package dequantizes that the loader accepts; anything else is refused by name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TENSOR_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
QUANTIZED = "quantized"  # the declared float type of a file whose weights are quantized

# The keys under "<architecture>." the engine reads (and checks below); any other key there may change the
# math (a sliding window, experts, soft-capping...) and is refused by name.
_KNOWN_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
})
# Where a key holds a value that is the engine's default (off), it changes nothing and is accepted.
_OFF_ARCH_KEYS = {"expert_count": 0, "expert_used_count": 0, "attention.sliding_window": 0,
                  "attention.causal": True, "pooling_type": 0}
_ROPE_SCALING_TYPES = ("none", "linear")  # llama.cpp's names; yarn, longrope... are refused


def gguf_path(source: str | Path) -> Path | None:
    """The GGUF file a model source names: a .gguf file, or a directory without config.json that holds
    exactly one (ValueError when it holds several). None for anything else."""
    path = Path(source)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}): "
                         f"name one with --model {path}/FILE.gguf")
    return files[0] if files else None


@dataclass
class GgufMetadata:
    """The key/value metadata and tensor list of one GGUF file (the tensors' data is memory-mapped, not read)."""

    path: Path
    reader: Any  # gguf.GGUFReader

    @classmethod
    def open(cls, path: str | Path) -> "GgufMetadata":
        from gguf import GGUFReader

        try:
            return cls(Path(path), GGUFReader(str(path)))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None

    @cached_property
    def values(self) -> dict[str, Any]:
        return {name: field.contents() for name, field in self.reader.fields.items()}

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} in {self.path.name} (general.architecture): "
                             f"the engine implements {', '.join(SUPPORTED_ARCHITECTURES)}")
        return arch

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(tensor.name for tensor in self.reader.tensors)

    def check_tensor_types(self) -> None:
        """Refuses, by name, the first tensor of a type outside SUPPORTED_TENSOR_TYPES."""
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise ValueError(f"unsupported GGUF tensor type {tensor.tensor_type.name} (tensor {tensor.name!r} in "
                                 f"{self.path.name}): supported are {', '.join(SUPPORTED_TENSOR_TYPES)}")

    @property
    def float_type(self) -> str:
        """What the weights are stored as: float32, float16, bfloat16, or QUANTIZED (any quantized matrix)."""
        matrix_types = {t.tensor_type.name for t in self.reader.tensors if len(t.shape) > 1}
        if matrix_types - set(FLOAT_TENSOR_TYPES):
            return QUANTIZED
        for name in ("BF16", "F16", "F32"):  # the narrowest float type present is the file's own
            if name in matrix_types:
                return FLOAT_TENSOR_TYPES[name]
        return "float32"

    def hf_config(self) -> dict[str, Any]:
        """The config.json this file's metadata amounts to (transformers' names), checked for keys that
        change the math and are not implemented."""
        arch = self.architecture
        self._check_arch_keys(arch)

        def key(name: str, default: Any = None) -> Any:
            return self.get(f"{arch}.{name}", default)

        heads = _required(key("attention.head_count"), f"{arch}.attention.head_count")
        hidden = _required(key("embedding_length"), f"{arch}.embedding_length")
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
        self._check_head_dim(arch, head_dim)
        names = set(self.tensor_names)
        config = {
            "model_type": arch,
            "vocab_size": key("vocab_size") or len(self.get("tokenizer.ggml.tokens") or ()) or None,
            "hidden_size": hidden,
            "intermediate_size": _required(key("feed_forward_length"), f"{arch}.feed_forward_length"),
            "num_hidden_layers": _required(key("block_count"), f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv") or heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(arch),
            "max_position_embeddings": key("context_length", 2048),
            # llama.cpp writes the output matrix only when it is not the embedding's
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids or None,
            "torch_dtype": self.float_type if self.float_type != QUANTIZED else "float32",
        }
        if config["vocab_size"] is None:
            raise ValueError(f"{self.path.name} states no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
        return config

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a generation: llama.cpp stops at end-of-sequence, end-of-turn and
        end-of-message alike."""
        ids = [self.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _check_arch_keys(self, arch: str) -> None:
        for name, value in self.values.items():
            if not name.startswith(f"{arch}."):
                continue
            short = name[len(arch) + 1:]
            if short in _KNOWN_ARCH_KEYS or (short in _OFF_ARCH_KEYS and value == _OFF_ARCH_KEYS[short]):
                continue
            raise ValueError(f"unsupported GGUF metadata {name} = {value!r} in {self.path.name}: the engine does not "
                             f"implement it, and running without it would change the output")
        if self.get("split.count", 1) != 1:
            raise ValueError(f"{self.path.name} is one part of a split GGUF (split.count {self.get('split.count')}): "
                             f"merge the parts into one file first (llama.cpp's gguf-split --merge)")

    def _check_head_dim(self, arch: str, head_dim: int) -> None:
        for name in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            value = self.get(f"{arch}.{name}")
            if value is not None and value != head_dim:
                raise ValueError(f"unsupported GGUF metadata {arch}.{name} = {value} in {self.path.name}: the engine "
                                 f"implements {head_dim} (keys, values and rope over the whole head)")

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        kind = self.get(f"{arch}.rope.scaling.type", "none")
        if kind not in _ROPE_SCALING_TYPES:
            raise ValueError(f"unsupported GGUF metadata {arch}.rope.scaling.type = {kind!r} in {self.path.name}: "
                             f"the engine implements {', '.join(_ROPE_SCALING_TYPES)}")
        factor = self.get(f"{arch}.rope.scaling.factor")
        if kind == "none" or factor in (None, 1.0):
            return None
        return {"rope_type": "linear", "factor": float(factor)}


def _required(value: Any, key: str) -> Any:
    if value is None:
        raise ValueError(f"the GGUF metadata has no {key}")
    return value
