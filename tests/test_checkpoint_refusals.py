"""Every checkpoint either runs as transformers does or is refused with an error that names the reason:
EOS lists and generation_config.json, the fidelity guard on config fields and weights, and a KV pool
too small for the model length (which used to leave a request waiting forever)."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.llm_engine import LLMEngine
from shared.engine.model.fidelity import MATH_FIELDS
from shared.engine.model.loader import load_model, random_model, save_pretrained
from shared.engine.model.model_config import ModelArchConfig
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig

SMALL = ModelArchConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _engine(path, **cache) -> LLMEngine:
    return LLMEngine(path, SchedulerConfig(max_model_len=256),
                     CacheConfig(**{"block_size": 16, "num_blocks": 64, **cache}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_pretrained(random_model(SMALL, seed=3), path)
    return path


def _with_config(src, dst, **changes):
    """A copy of the checkpoint directory with config.json fields changed (None removes one)."""
    dst.mkdir(exist_ok=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


# ---- EOS lists and generation_config.json -----------------------------------------------------------

@pytest.fixture(scope="module")
def free_run(checkpoint):
    [out] = _engine(checkpoint).generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    return out.token_ids


def _first_new(tokens: list[int], start: int) -> int:
    """A token of the free run that does not occur before position start (so it first ends the run there)."""
    return next(t for t in tokens[start:] if t not in tokens[:start])


@pytest.mark.timeout(60, method="thread")
def test_every_eos_id_of_a_list_stops_generation(checkpoint, free_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    early = _first_new(free_run, 2)
    late = _first_new(free_run, free_run.index(early) + 1)  # the primary EOS, listed first, comes later
    path = _with_config(checkpoint, tmp_path / "eos-list", eos_token_id=[late, early])
    [out] = _engine(path).generate([PROMPT], SamplingParams(max_tokens=12))
    stop = free_run.index(early)
    assert out.token_ids == free_run[:stop + 1]
    assert out.finish_reason.value == "stop" and out.stop_reason == early  # a further EOS reports itself
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert reference[0, len(PROMPT):].tolist() == out.token_ids


@pytest.mark.timeout(60, method="thread")
def test_generation_config_adds_eos_ids_and_sampling_defaults(checkpoint, free_run, tmp_path):
    eos = _first_new(free_run, 4)
    never = next(t for t in range(SMALL.vocab_size) if t not in free_run)
    path = _with_config(checkpoint, tmp_path / "generation", eos_token_id=never)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
         "repetition_penalty": 1.1, "max_new_tokens": 12}))
    engine = _engine(path)
    assert engine.eos_token_ids[1:] == (eos,)
    defaults = engine.generation.sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty,
            defaults.max_tokens) == (0.7, 0.9, 20, 1.1, 12)
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=12))
    assert out.token_ids == free_run[:free_run.index(eos) + 1]
    # A request's unset fields take the defaults; its explicit ones win (vLLM's --generation-config auto).
    filled = engine.generation.fill(SamplingParams(temperature=1.0, top_k=3, unset={"temperature", "top_p"}))
    assert (filled.temperature, filled.top_p, filled.top_k, filled.repetition_penalty, filled.unset) == \
        (0.7, 0.9, 3, 1.0, frozenset())
    # max_new_tokens is a default, not a cap (vLLM's get_max_tokens since its PR 34063): an unset
    # max_tokens takes it within the room the prompt leaves (at least 1); a named one stays.
    silent = SamplingParams(max_tokens=200, unset={"max_tokens"})
    assert [engine.generation.fill(silent, room).max_tokens for room in (100, 5, 0)] == [12, 5, 1]
    assert engine.generation.fill(SamplingParams(max_tokens=200), room=300).max_tokens == 200
    assert "max_tokens=12 (for requests that name none" in engine.generation.describe()
    [out] = engine.generate([PROMPT], SamplingParams(ignore_eos=True, unset={"max_tokens"}))
    assert len(out.token_ids) == 12
    # --generation-config vllm: the file's sampling is ignored, its EOS ids still end requests.
    ignored = load_model(path, generation_config="vllm").generation
    assert (ignored.sampling, ignored.eos_token_ids) == ({}, engine.eos_token_ids)
    assert ignored.fill(silent, room=100).max_tokens == 200  # the request's fallback
    # do_sample false means greedy, whatever temperature the file names (transformers' reading).
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert load_model(path).generation.sampling_params().is_greedy
    assert load_model(path).generation.fill(SamplingParams(temperature=1.0, unset={"temperature"})).is_greedy


def test_generation_config_from_a_folder_and_overrides(checkpoint, tmp_path):
    """vLLM's --generation-config PATH and --override-generation-config."""
    path = _with_config(checkpoint, tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12}))
    folder = tmp_path / "recommended"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5, "min_p": 0.05}))
    assert load_model(path, generation_config=str(folder)).generation.sampling == {
        "temperature": 0.3, "top_k": 5, "min_p": 0.05}
    merged = load_model(path, generation_overrides={"temperature": 0.5, "repetition_penalty": 1.2}).generation
    assert merged.sampling == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 12, "repetition_penalty": 1.2}
    greedy = load_model(path, generation_overrides={"do_sample": False}).generation
    assert greedy.sampling_params().is_greedy and greedy.sampling["max_tokens"] == 12
    only = load_model(path, generation_config="vllm", generation_overrides={"top_k": 8}).generation
    assert only.sampling == {"top_k": 8}
    assert load_model(path, generation_config="vllm", generation_overrides={"min_p": 0.1}).generation.sampling == {
        "min_p": 0.1}
    with pytest.raises(ValueError, match="typical_p cannot be set"):
        load_model(path, generation_overrides={"typical_p": 0.9})
    with pytest.raises(ValueError, match="is neither"):
        load_model(path, generation_config=str(tmp_path / "missing"))


@pytest.mark.timeout(60, method="thread")
def test_prefill_sees_every_eos_id_for_token_one(checkpoint, free_run, tmp_path):
    """A producer whose token 1 is a further EOS id hands nothing off: the request ends with stop."""
    from loopback_connector import LoopbackConnector, LoopbackKVStore
    from shared.engine.kv_transfer.connector import KVRole
    from shared.engine.kv_transfer.handoff import HoldForPeer
    from shared.engine.request import Request

    never = next(t for t in range(SMALL.vocab_size) if t not in free_run)
    path = _with_config(checkpoint, tmp_path / "eos-first", eos_token_id=[never, free_run[0]])
    connector = LoopbackConnector(KVRole.PRODUCER, LoopbackKVStore(), "prefill", block_size=16)
    engine = LLMEngine(path, SchedulerConfig(max_model_len=256), CacheConfig(block_size=16, num_blocks=64),
                       connector=connector)
    engine.add_request(Request("r", PROMPT, SamplingParams(max_tokens=8), None, kv_transfer_params=HoldForPeer()))
    finals = [out for _ in range(4) for out in engine.step() if out.finished]
    assert [(o.new_token_ids, o.finish_reason.value, o.kv_handle) for o in finals] == [([free_run[0]], "stop", None)]


# ---- the fidelity guard ---------------------------------------------------------------------------

UNSUPPORTED_VALUES = {
    "model_type": "gpt_neox",
    "hidden_act": "gelu",
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "partial_rotary_factor": 0.5,
    "torch_dtype": "float8_e4m3fn",
    "dtype": "int8",
    "layer_types": ["full_attention", "chunked_attention"],
    "quantization_config": {"quant_method": "awq", "bits": 4},
    "compression_config": {"format": "pack-quantized"},
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "use_qk_norm": True,
    "no_rope_layers": [1, 0],
    "dual_chunk_attention_config": {"chunk_size": 8192},
    "use_bidirectional_attention": True,
    "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
    "num_experts": 8,
    "num_local_experts": 8,
}


def test_every_guarded_field_has_a_refusal_test():
    assert set(UNSUPPORTED_VALUES) == set(MATH_FIELDS)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_VALUES))
def test_unsupported_config_field_is_refused_by_name(field):
    hf = {**SMALL.to_hf_dict(), field: UNSUPPORTED_VALUES[field]}
    with pytest.raises(ValueError, match=f"unsupported {field} "):
        ModelArchConfig.from_hf_dict(hf)


def test_supported_values_of_guarded_fields_load():
    hf = {**SMALL.to_hf_dict(), "quantization_config": None, "partial_rotary_factor": 1.0,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "torch_dtype": "float16"}
    config = ModelArchConfig.from_hf_dict(hf)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0} and config.dtype == "float32"


def test_a_weight_the_config_does_not_account_for_is_refused(checkpoint, tmp_path):
    # The checkpoint has no biases; a config saying so for a biased checkpoint would drop them silently.
    biased = tmp_path / "biased"
    save_pretrained(random_model(ModelArchConfig(**{**SMALL.__dict__, "attention_bias": True}), seed=3), biased)
    path = _with_config(biased, tmp_path / "unbiased-config", attention_bias=False)
    with pytest.raises(ValueError, match=r"does not account for: \['model.layers.0.self_attn.k_proj.bias'"):
        load_model(path)


# ---- a KV pool too small for the model length --------------------------------------------------------

def test_startup_refuses_a_model_length_the_pool_cannot_hold():
    with pytest.raises(ValueError, match=r"max_model_len 256 does not fit the KV pool: 10 blocks of 16 tokens "
                                         r"hold 144 tokens .* at least 17 blocks"):
        LLMEngine("tiny", SchedulerConfig(max_model_len=256), CacheConfig(block_size=16, num_blocks=10))


@pytest.mark.timeout(60, method="thread")
def test_a_prompt_longer_than_the_pool_is_refused_at_admission_not_left_waiting():
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=144), CacheConfig(block_size=16, num_blocks=10))
    with pytest.raises(ValueError, match="prompt of 200 tokens leaves no room to generate within max_model_len 144"):
        engine.generate([list(range(1, 201))], SamplingParams(max_tokens=4))
    # The longest request the pool holds still runs to completion.
    [out] = engine.generate([list(range(1, 140))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason.value == "length"


# ---- --dtype auto ---------------------------------------------------------------------------------------

def test_dtype_auto_is_the_checkpoint_dtype_on_a_gpu_and_bfloat16_on_a_bfloat16_cpu(tmp_path, caplog, monkeypatch):
    from shared.engine.model import dtype_choice

    save_pretrained(random_model(ModelArchConfig(**{**SMALL.__dict__, "dtype": "bfloat16"}), seed=3), tmp_path)
    with caplog.at_level("INFO", logger="shared.engine.model.loader"):
        monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: ())
        assert load_model(tmp_path, dtype="auto", device="cpu").config.dtype == "float32"
        monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: ("avx512_bf16",))
        assert load_model(tmp_path, dtype="auto", device="cpu").config.dtype == "bfloat16"
        assert load_model("tiny", dtype="auto", device="cpu").config.dtype == "float32"  # a float32 checkpoint
        # Resolved, not moved: the weights load on the CPU either way, so this runs without a GPU.
        assert load_model(tmp_path, dtype="auto", device="cuda").config.dtype == "bfloat16"
        assert load_model(tmp_path, dtype="float32", device="cuda").config.dtype == "float32"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "dtype float32 (auto: the checkpoint is bfloat16 but the CPU has no AVX512-BF16 or AMX)",
        "dtype bfloat16 (auto: the checkpoint is bfloat16 and the CPU has avx512_bf16)",
        "dtype float32 (auto: the checkpoint is float32)",
        "dtype bfloat16 (auto: the checkpoint is bfloat16, on a GPU)", "dtype float32 (as asked)"]
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tmp_path, dtype="float16")


def test_cpu_bfloat16_flags_are_read_from_cpuinfo(tmp_path):
    from shared.engine.model.dtype_choice import cpu_bf16_flags

    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 avx512_bf16\n")
    assert cpu_bf16_flags(tmp_path / "cpuinfo") == ("avx512_bf16", "amx_bf16")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_bf16_flags(tmp_path / "cpuinfo") == ()
    assert cpu_bf16_flags(tmp_path / "absent") == ()
