"""Builds a LlamaModel from a Hugging Face directory or a built-in preset with seeded random weights,
and writes our weights back out as an HF-format directory (so transformers can load the same model).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.engine.gguf_tokenizer import tokenizer_from_gguf
from shared.engine.model.checkpoint_json import read_json_object
from shared.engine.model.dtype_choice import DTYPE_AUTO, DTYPE_CHOICES, auto_dtype
from shared.engine.model.fetched_presets import FETCHED_PRESETS, resolve_model_source
from shared.engine.model.gguf_metadata import GgufMetadata, gguf_path
from shared.engine.model.gguf_weights import read_gguf_weights
from shared.engine.model.generation_config import GENERATION_CONFIG_AUTO, GenerationDefaults, generation_defaults
from shared.engine.model.model_config import LARGE_PRESETS, PRESETS, ModelArchConfig, preset
from shared.engine.model.llama import LlamaModel
from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

INIT_STD = 0.02


@dataclass
class LoadedModel:
    config: ModelArchConfig
    model: LlamaModel
    tokenizer: Any | None  # tokenizers.Tokenizer when the directory has tokenizer.json
    generation: GenerationDefaults  # every EOS id and the default sampling parameters


def load_model(source: str | Path, dtype: str | None = DTYPE_AUTO, seed: int = 0,
               device: torch.device | str = "cpu", generation_config: str = GENERATION_CONFIG_AUTO,
               generation_overrides: dict[str, Any] | None = None) -> LoadedModel:
    """source: a preset name ("tiny", "100m") for random weights from seed, "smollm2-135m" (a real model,
    fetched at first use), an HF model directory, or a GGUF file (or a directory holding one).
    dtype: "float32", "bfloat16", or "auto" (None too): see dtype_choice.auto_dtype.
    generation_config: "auto" takes generation_config.json's sampling defaults, "vllm" ignores them, a
    folder's path takes those of its generation_config.json; generation_overrides (that file's field
    names) go on top."""
    if dtype not in (None, *DTYPE_CHOICES):
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    source = resolve_model_source(str(source)) if isinstance(source, str) else source
    gguf = None if isinstance(source, str) and source in PRESETS else gguf_path(source)
    metadata = GgufMetadata.open(gguf) if gguf is not None else None
    if dtype in (None, DTYPE_AUTO):
        native = metadata.float_type if metadata is not None else _checkpoint_dtype(source)
        dtype, how = auto_dtype(native, device)
        how = f"auto: {how}"
    else:
        how = "as asked"
    if metadata is not None:
        loaded = _load_gguf(metadata, dtype, generation_config, generation_overrides)
    else:
        loaded = _load(source, dtype, seed, device, generation_config, generation_overrides)
    logger.info("model %s: dtype %s (%s)", loaded.config.name, loaded.config.dtype, how)
    return loaded


def _checkpoint_dtype(source: str | Path) -> str:
    """The dtype a preset or an HF directory's config.json declares (float32 when it declares none)."""
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source].dtype
    config_path = Path(source) / "config.json"
    if not config_path.is_file():
        return "float32"  # _load refuses the source with its own message
    hf = read_json_object(config_path)
    declared = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return {"float": "float32", "half": "float16"}.get(declared, declared)


def _load_gguf(metadata: GgufMetadata, dtype: str, generation_config: str,
               generation_overrides: dict[str, Any] | None) -> LoadedModel:
    """A GGUF file: config, tokenizer and weights from the one file (its metadata), dequantized to dtype."""
    config = ModelArchConfig.from_hf_dict(metadata.hf_config(), name=metadata.path.stem, dtype=dtype)
    model = LlamaModel(config)
    load_hf_weights(model, read_gguf_weights(metadata, config.num_heads, config.num_kv_heads, config.torch_dtype))
    try:
        tokenizer = tokenizer_from_gguf(metadata)
    except ValueError as exc:
        logger.warning("%s: serving token ids only", exc)
        tokenizer = None
    return LoadedModel(config=config, model=model.eval(), tokenizer=tokenizer,
                       generation=generation_defaults(config.eos_token_ids, None, generation_config,
                                                      generation_overrides))


def _load(source: str | Path, dtype: str, seed: int, device: torch.device | str,
          generation_config: str, generation_overrides: dict[str, Any] | None) -> LoadedModel:
    if isinstance(source, str) and source in PRESETS:
        config = preset(source, dtype)
        # The presets ship their own tokenizer, so the built-in models take text (the large ones: ids only).
        directory = preset_tokenizer_dir(source)
        tokenizer = load_tokenizer(directory) if directory is not None else None
        # A large preset is built where it runs (no CPU copy of its weights); the others on the CPU,
        # so a preset has the same weights on every device.
        build_on = device if source in LARGE_PRESETS else "cpu"
        return LoadedModel(config=config, model=random_model(config, seed, build_on), tokenizer=tokenizer,
                           generation=generation_defaults(config.eos_token_ids, None, generation_config,
                                                          generation_overrides))
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"model {str(source)!r} is neither a built-in ({sorted([*PRESETS, *FETCHED_PRESETS])}), "
                         f"a directory, nor a .gguf file")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json")
    config = ModelArchConfig.from_json_file(config_path, dtype=dtype)
    model = LlamaModel(config)
    load_hf_weights(model, _read_safetensors(path, config.torch_dtype))
    return LoadedModel(config=config, model=model.eval(), tokenizer=load_tokenizer(path, required=False),
                       generation=generation_defaults(config.eos_token_ids, path, generation_config,
                                                      generation_overrides))


def random_model(config: ModelArchConfig, seed: int, device: torch.device | str = "cpu") -> LlamaModel:
    """Deterministic random weights, allocated and drawn on device: the same (config, seed, device type)
    gives the same model in any process (CPU and CUDA generators draw different values)."""
    model = LlamaModel(config, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith("rotary."):
            continue
        # One tensor's float32 draw at a time: the 8B preset's largest (the embedding) is 2 GB.
        values = torch.randn(tensor.shape, generator=generator, device=tensor.device)
        if name.endswith("norm.weight"):
            # Not all ones, so a wrong norm weight shows up in the parity tests.
            values = 1.0 + 0.1 * values
        else:
            values = INIT_STD * values
        tensor.copy_(values.to(tensor.dtype))
    return model.eval()


# ---- Hugging Face weight names <-> our fused layout ---------------------------------------------

def to_hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    return {name: t.contiguous() for name, t in _hf_views(model).items()}


def _hf_views(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every weight of the model under its Hugging Face name: views into our fused tensors (q|k|v and
    gate|up split back apart), so a checkpoint's tensors copy straight into them."""
    config = model.config
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.qkv_proj.weight.split((q_size, kv_size, kv_size))
        out.update({
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": layer.o_proj.weight,
            prefix + "input_layernorm.weight": layer.input_layernorm.weight,
            prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            prefix + "mlp.down_proj.weight": layer.down_proj.weight,
        })
        gate, up = layer.gate_up_proj.weight.split(config.intermediate_size)
        out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
        if layer.qkv_proj.bias is not None:
            qb, kb, vb = layer.qkv_proj.bias.split((q_size, kv_size, kv_size))
            out.update({prefix + "self_attn.q_proj.bias": qb, prefix + "self_attn.k_proj.bias": kb,
                        prefix + "self_attn.v_proj.bias": vb})
        if layer.o_proj.bias is not None:
            out[prefix + "self_attn.o_proj.bias"] = layer.o_proj.bias
        if layer.gate_up_proj.bias is not None:
            gate_b, up_b = layer.gate_up_proj.bias.split(config.intermediate_size)
            out.update({prefix + "mlp.gate_proj.bias": gate_b, prefix + "mlp.up_proj.bias": up_b,
                        prefix + "mlp.down_proj.bias": layer.down_proj.bias})
        if layer.q_norm is not None:
            out[prefix + "self_attn.q_norm.weight"] = layer.q_norm.weight
            out[prefix + "self_attn.k_norm.weight"] = layer.k_norm.weight
    return out


# Checkpoint entries that carry no weights of their own: rope tables some exporters save, and the LM head
# of a tied model (the embedding is the head).
_DERIVED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def check_hf_weights(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], tied: bool) -> None:
    """Refuses, by name, a missing weight, one whose shape is not the model's (checked on each Hugging Face
    tensor, before fusing, where a short k_proj and a long v_proj would add up to the right q|k|v), and one
    the config does not account for (a bias with attention_bias false, say: dropping it would silently
    change the output). expected: the model's own tensors by Hugging Face name (_hf_views)."""
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"checkpoint is missing weight {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in expected.items():
        if weights[name].shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected "
                             f"{tuple(tensor.shape)} from config.json")
    unused = sorted(name for name in weights if name not in expected and not name.endswith(_DERIVED_WEIGHT_SUFFIXES)
                    and not (tied and name == "lm_head.weight"))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(f"checkpoint has weights config.json does not account for: {unused[:5]}{more}")


def load_hf_weights(model: LlamaModel, weights: dict[str, torch.Tensor]) -> None:
    """Copies a checkpoint's weights (checked first, see check_hf_weights) into our fused layout, through
    the model's Hugging Face-named views of it."""
    with torch.no_grad():
        targets = _hf_views(model)
        check_hf_weights(targets, weights, tied=model.lm_head is None)
        for name, target in targets.items():
            target.copy_(weights[name])


# transformers' names, in the order from_pretrained looks for them: one file, else the index of shards.
SAFE_WEIGHTS_FILE = "model.safetensors"
SAFE_WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[str]:
    """The files transformers' from_pretrained reads: model.safetensors when present, else exactly those the
    index's weight_map names. Any other *.safetensors (a consolidated.safetensors beside them, say) is not
    part of the model. With neither file, every *.safetensors, as vLLM loads such a folder (transformers
    would refuse it)."""
    if (path / SAFE_WEIGHTS_FILE).is_file():
        return [SAFE_WEIGHTS_FILE]
    index_file = path / SAFE_WEIGHTS_INDEX_FILE
    if not index_file.is_file():
        present = sorted(p.name for p in path.glob("*.safetensors"))
        if not present:
            raise ValueError(f"{path} has no *.safetensors files (neither {SAFE_WEIGHTS_FILE} nor "
                             f"{SAFE_WEIGHTS_INDEX_FILE} with its shards)")
        return present
    weight_map = read_json_object(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_file} has no weight_map naming the weight files")
    files = sorted(set(weight_map.values()))
    absent = [name for name in files if not isinstance(name, str) or not (path / name).is_file()]
    if absent:
        raise ValueError(f"{index_file} names weight files {absent} that {path} does not hold")
    return files


def _read_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file_name in safetensors_files(path):
        with safe_open(str(path / file_name), framework="pt") as f:
            for name in f.keys():
                if name in weights:
                    raise ValueError(f"weight {name!r} is in both {origin[name]} and {file_name} of {path}")
                weights[name], origin[name] = f.get_tensor(name).to(dtype), file_name
    return weights


def save_pretrained(loaded_or_model: LoadedModel | LlamaModel, path: str | Path,
                    max_shard_bytes: int | None = None) -> Path:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is exceeded)."""
    model = loaded_or_model.model if isinstance(loaded_or_model, LoadedModel) else loaded_or_model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with (path / "config.json").open("w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    state = to_hf_state_dict(model)
    shards = _shard(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(path / SAFE_WEIGHTS_FILE), metadata={"format": "pt"})
        return path
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        file_name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with (path / SAFE_WEIGHTS_INDEX_FILE).open("w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


def _shard(state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if max_shard_bytes is None:
        return [state]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
