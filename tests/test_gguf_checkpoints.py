"""GGUF checkpoints (llama.cpp's format) written here with gguf's own writer, for small random Llama, Qwen2
and Qwen3 models in every supported tensor type: the engine's weights equal transformers' load of the same
file bit for bit, greedy tokens equal transformers' generate(), and what the engine does not implement (a
tensor type, an architecture, a metadata key, a tensor) is refused by name."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF

from gguf import GGMLQuantizationType, GGUFValueType  # noqa: E402

from gguf_files import write_gguf  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.model.gguf_metadata import SUPPORTED_TENSOR_TYPES, GgufMetadata, gguf_path  # noqa: E402
from shared.engine.model.loader import load_model, random_model, to_hf_state_dict  # noqa: E402
from shared.engine.model.model_config import ModelArchConfig  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402
from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402

# Rows of 256 values: the K-quants' block.
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, max_position_embeddings=512,
             bos_token_id=None, eos_token_id=None)
CONFIGS = {
    "llama": ModelArchConfig(model_type="llama", num_layers=2, num_heads=4, num_kv_heads=2, **SMALL),
    "qwen2": ModelArchConfig(model_type="qwen2", num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=1e6,
                             **SMALL),
    # head_dim 128: transformers' Qwen3 reads no head_dim from a GGUF and takes its default, 128.
    "qwen3": ModelArchConfig(model_type="qwen3", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                             tie_word_embeddings=True, **SMALL),
}
# One file per architecture with every tensor type at once, for the greedy runs.
MIXED_TYPES = {"*": "Q4_K", "token_embd.weight": "Q8_0", "output.weight": "Q6_K",
               "blk.0.attn_q.weight": "Q5_K", "blk.0.attn_k.weight": "Q3_K", "blk.0.attn_v.weight": "Q2_K",
               "blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_1", "blk.0.ffn_down.weight": "Q5_0",
               "blk.1.attn_q.weight": "Q5_1", "blk.1.attn_k.weight": "F16", "blk.1.attn_v.weight": "BF16",
               "blk.1.attn_output.weight": "F32"}
_rng = random.Random(23)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (4, 17, 33, 60)]
NUM_OUTPUT = 16


def _transformers_load(path):
    config = transformers.GgufConfig(dequantize=True)  # dense weights: transformers' own dequantization
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, quantization_config=config,
        attn_implementation="eager").eval()


@pytest.mark.e2e  # 39 loads through transformers, seconds in all; the fast lane's mixed files cover every type
@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_weights_equal_transformers_load(tmp_path, arch, tensor_type):
    path = write_gguf(tmp_path / f"{arch}-{tensor_type}.gguf", CONFIGS[arch], tensor_type)
    ours = to_hf_state_dict(load_model(str(path), dtype="float32").model)
    theirs = _transformers_load(path).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_float32_file_round_trips_to_the_written_weights(tmp_path):
    """Llama's q/k rows come back in transformers' order: llama.cpp's permutation is undone exactly."""
    config = CONFIGS["llama"]
    path = write_gguf(tmp_path / "llama.gguf", config, "F32")
    loaded = load_model(str(path), dtype="float32")
    expected = to_hf_state_dict(random_model(config, seed=7))
    for name, tensor in to_hf_state_dict(loaded.model).items():
        assert torch.equal(tensor, expected[name]), name
    assert loaded.config.tie_word_embeddings is False and loaded.config.dtype == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_tokens_equal_transformers(tmp_path, arch):
    """A file with every tensor type at once: its weights equal transformers' load bit for bit, and so do
    the greedy tokens."""
    path = write_gguf(tmp_path / f"{arch}-mixed.gguf", CONFIGS[arch], MIXED_TYPES)
    hf = _transformers_load(path)
    with one_torch_thread(), torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=NUM_OUTPUT, min_new_tokens=NUM_OUTPUT, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    engine = LLMEngine(str(path), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256),
                       CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=True), dtype="float32")
    theirs = hf.state_dict()
    for name, tensor in to_hf_state_dict(engine.runner.model).items():
        assert torch.equal(tensor, theirs[name]), name
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_OUTPUT, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


def test_declared_float_type_and_config(tmp_path):
    f16 = GgufMetadata.open(write_gguf(tmp_path / "f16.gguf", CONFIGS["qwen3"], "F16"))
    assert f16.float_type == "float16"
    assert f16.hf_config()["tie_word_embeddings"] is True
    assert GgufMetadata.open(write_gguf(tmp_path / "q.gguf", CONFIGS["qwen2"], MIXED_TYPES)).float_type == "quantized"
    assert GgufMetadata.open(write_gguf(tmp_path / "b.gguf", CONFIGS["llama"], "BF16")).float_type == "bfloat16"


def test_directory_with_one_gguf_is_the_model_and_with_two_is_refused(tmp_path):
    path = write_gguf(tmp_path / "only.gguf", CONFIGS["llama"], "F32")
    assert gguf_path(tmp_path) == path
    write_gguf(tmp_path / "second.gguf", CONFIGS["llama"], "F32")
    with pytest.raises(ValueError, match="several GGUF files"):
        load_model(str(tmp_path))


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    config = CONFIGS["llama"]
    path = write_gguf(tmp_path / "iq.gguf", config, "F32")
    _retype_tensor(path, "blk.1.ffn_up.weight", "IQ4_NL")
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type IQ4_NL \(tensor 'blk.1.ffn_up.weight'"):
        load_model(str(path), dtype="float32")


def _retype_tensor(path, name: str, type_name: str) -> None:
    """Rewrites a file with one tensor's blocks in another type (random bytes of that type's size)."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    out = path.with_suffix(".tmp")
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kinds = field.types
        sub = kinds[1] if kinds[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kinds[0], sub_type=sub)
    qtype = GGMLQuantizationType[type_name]
    for tensor in reader.tensors:
        if tensor.name != name:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        values, size = GGML_QUANT_SIZES[qtype]
        blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // values * size), dtype=np.uint8)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.replace(path)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", CONFIGS["llama"], "F32")
    _rename_architecture(path, "gemma2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        load_model(str(path), dtype="float32")


def _rename_architecture(path, arch: str) -> None:
    """general.architecture and every key under the old name, renamed in place (same byte length)."""
    data = path.read_bytes()
    assert len(arch) >= len("llama")
    path.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                  len(arch).to_bytes(8, "little") + arch.encode()))


@pytest.mark.parametrize("key, value, kind", [
    ("llama.attention.sliding_window", 64, GGUFValueType.UINT32),
    ("llama.expert_count", 8, GGUFValueType.UINT32),
    ("llama.attn_logit_softcapping", 50.0, GGUFValueType.FLOAT32),
    ("llama.rope.scaling.type", "yarn", GGUFValueType.STRING),
])
def test_metadata_that_changes_the_math_is_refused_by_name(tmp_path, key, value, kind):
    path = write_gguf(tmp_path / "extra.gguf", CONFIGS["llama"], "F32", extra_metadata={key: (value, kind)})
    with pytest.raises(ValueError, match=f"unsupported GGUF metadata {key}"):
        load_model(str(path), dtype="float32")


def test_partial_rotary_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "rot.gguf", CONFIGS["qwen2"], "F32",
                      extra_metadata={"qwen2.rope.dimension_count": (32, GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match="qwen2.rope.dimension_count = 32"):
        load_model(str(path), dtype="float32")
