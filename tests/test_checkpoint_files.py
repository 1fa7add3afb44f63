"""A checkpoint's files read as transformers reads them, or refused with an error naming the file, field or
weight: weight shapes checked before fusing, which *.safetensors files are the model, JSON that does not
parse, config fields of the wrong JSON type, and generation_config.json values vLLM and HF take as "off"."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine.model.loader import load_model, random_model, save_pretrained
from shared.engine.model.model_config import ModelArchConfig

SMALL = ModelArchConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_pretrained(random_model(SMALL, seed=3), path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _with_weights(src, dst, **changes):
    """A copy of the checkpoint with weights replaced (keys: names with "/" for ".")."""
    path = _copy(src, dst)
    weights = load_file(path / "model.safetensors")
    weights.update({name.replace("/", "."): tensor for name, tensor in changes.items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ---- weight shapes, each checked before q|k|v and gate|up are fused ----------------------------------------

@pytest.mark.slow
def test_k_and_v_of_wrong_rows_are_refused_though_their_sum_fits(checkpoint, tmp_path):
    # k 8 rows + v 24 rows = the expected 16 + 16: a check of the fused q|k|v alone let this load.
    path = _with_weights(checkpoint, tmp_path / "kv", **{"model/layers/0/self_attn/k_proj/weight": torch.zeros(8, 32),
                                                        "model/layers/0/self_attn/v_proj/weight": torch.zeros(24, 32)})
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.self_attn.k_proj.weight' has shape \(8, 32\), "
                                         r"expected \(16, 32\)"):
        load_model(path)


def test_a_weight_of_wrong_in_features_is_refused_by_name(checkpoint, tmp_path):
    path = _with_weights(checkpoint, tmp_path / "up", **{"model/layers/0/mlp/up_proj/weight": torch.zeros(48, 30)})
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.mlp.up_proj.weight' has shape \(48, 30\), "
                                         r"expected \(48, 32\)"):
        load_model(path)


# ---- which files hold the weights -------------------------------------------------------------------------

def test_model_safetensors_wins_over_a_stray_safetensors_file(checkpoint, tmp_path):
    # Mistral's releases ship consolidated.safetensors (its own names) beside the HF files.
    path = _copy(checkpoint, tmp_path / "consolidated")
    save_file({"tok_embeddings.weight": torch.zeros(64, 32)}, path / "consolidated.safetensors")
    reference = load_model(checkpoint).model.embed_tokens.weight
    assert torch.equal(load_model(path).model.embed_tokens.weight, reference)


def test_an_index_loads_exactly_the_files_it_names(tmp_path):
    path = save_pretrained(random_model(SMALL, seed=3), tmp_path / "sharded", max_shard_bytes=8_000)
    save_file({"tok_embeddings.weight": torch.zeros(64, 32)}, path / "consolidated.safetensors")
    load_model(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (path / first).unlink()
    with pytest.raises(ValueError, match=f"names weight files \\['{first}'\\] that .* does not hold"):
        load_model(path)


def test_a_folder_without_model_safetensors_or_an_index_loads_every_safetensors_like_vllm(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path / "renamed")
    (path / "model.safetensors").rename(path / "weights.safetensors")
    load_model(path)
    (path / "weights.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors files"):
        load_model(path)


# ---- JSON that does not parse, and fields of the wrong JSON type ------------------------------------------

@pytest.mark.parametrize("file_name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_malformed_json_names_the_file(checkpoint, tmp_path, file_name):
    path = _copy(checkpoint, tmp_path / "malformed")
    (path / file_name).write_text('{"temperature": 0.7,}')
    if file_name == "model.safetensors.index.json":
        (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match=f"{file_name} is not a readable JSON file"):
        load_model(path)


@pytest.mark.parametrize("field,value", [
    ("tie_word_embeddings", "false"), ("attention_bias", 0), ("hidden_size", 32.0), ("num_hidden_layers", True),
    ("rms_norm_eps", "1e-6"), ("sliding_window", "8"), ("rope_scaling", "linear"), ("layer_types", "full_attention"),
    ("eos_token_id", "2"),
])
def test_a_config_field_of_the_wrong_json_type_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"config.json: {field} must be "):
        ModelArchConfig.from_hf_dict({**SMALL.to_hf_dict(), field: value})


def test_a_config_without_a_size_field_names_it():
    hf = SMALL.to_hf_dict()
    del hf["vocab_size"]
    with pytest.raises(ValueError, match="config.json has no vocab_size"):
        ModelArchConfig.from_hf_dict(hf)


def _with_generation_config(src, dst, **fields):
    path = _copy(src, dst)
    (path / "generation_config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("fields,message", [
    ({"do_sample": "false"}, "do_sample must be boolean or null"),
    ({"temperature": "0.7"}, "temperature must be number or null"),
    ({"top_k": 2.5}, "top_k must be integer or null"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),  # transformers' GenerationConfig refuses it
    ({"top_k": -5}, "top_k must be an integer in"),
    ({"eos_token_id": ["2"]}, "eos_token_id entries must be non-negative integers"),
])
def test_a_bad_generation_config_field_names_the_file_and_field(checkpoint, tmp_path, fields, message):
    path = _with_generation_config(checkpoint, tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match=f"generation_config.json: {message}"):
        load_model(path)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_means_no_default_top_k(checkpoint, tmp_path, top_k):
    """transformers' 0 and vLLM's -1 both mean no top-k filter: not a default, not a refusal."""
    path = _with_generation_config(checkpoint, tmp_path / "top-k", do_sample=True, top_k=top_k, temperature=0.5)
    generation = load_model(path).generation
    assert generation.sampling == {"temperature": 0.5}
    assert generation.sampling_params().top_k == 0
