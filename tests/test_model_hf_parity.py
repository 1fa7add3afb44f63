"""Token-for-token parity with transformers (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) on
the same random weights saved as safetensors, through the full engine (scheduler + paged runner).

Five scheduling regimes must not change a single greedy token: plain, chunked prefill, prefix-cache
hits, preemption, and n-gram speculation. Prefill logits match the reference within a tight tolerance.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.model.attention import AttentionMetadata, SequenceSpan  # noqa: E402
from shared.engine.model.model_config import ModelArchConfig  # noqa: E402
from shared.engine.model.loader import load_model, random_model, save_pretrained  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402

NUM_OUTPUT = 16
BLOCK_SIZE = 16
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2,
             max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
MODELS = {
    "llama": ModelArchConfig(model_type="llama", num_layers=3, rope_scaling=LLAMA3_SCALING, **SMALL),
    "qwen2": ModelArchConfig(model_type="qwen2", num_layers=2, rms_norm_eps=1e-6, rope_theta=1e6, **SMALL),
}
EXTRA_LOGIT_MODELS = {
    "qwen2-tied": ModelArchConfig(model_type="qwen2", num_layers=2, tie_word_embeddings=True, **SMALL),
    "mistral": ModelArchConfig(model_type="mistral", num_layers=2, **SMALL),
}

_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (3, 9, 16, 17, 31, 48, 70, 100)]
_shared_prefix = [_rng.randrange(512) for _ in range(40)]
PREFIX_PROMPTS = [_shared_prefix + [_rng.randrange(512) for _ in range(n)] for n in (1, 5, 12, 24, 33, 50)]
PREFIX_PROMPTS += [PROMPTS[6], PROMPTS[7]]  # exact repeats of prompts served earlier in the same engine

SCENARIOS = {
    # name: (scheduler kwargs, cache kwargs)
    "plain": ({}, {}),
    "chunked_prefill": ({"max_num_batched_tokens": 20}, {}),
    "prefix_cache": ({}, {}),
    "preemption": ({"max_model_len": 176}, {"num_blocks": 12}),  # the pool holds 11 blocks of 16
    "ngram_spec": ({"num_speculative_tokens": 3, "speculative_method": "ngram"}, {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (model dir, HF model): our random weights written as safetensors, read by transformers."""
    out = {}
    for name, config in {**MODELS, **EXTRA_LOGIT_MODELS}.items():
        path = tmp_path_factory.mktemp(name)
        # The Llama checkpoint is sharded, so the index-file path of the loader is exercised too.
        save_pretrained(random_model(config, seed=7), path, max_shard_bytes=150_000 if name == "llama" else None)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        out[name] = (path, hf)
    return out


def _hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                          pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    with one_torch_thread():
        for name in MODELS:
            hf = checkpoints[name][1]
            refs[name] = {tuple(p): _hf_greedy(hf, p, NUM_OUTPUT) for p in PROMPTS + PREFIX_PROMPTS}
    return refs


# The engine runs where the model lives; on a machine with a GPU every scenario also runs there.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _engine(path, scheduler_kwargs, cache_kwargs, device: str = "cpu") -> LLMEngine:
    scheduler_config = SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 2048,
                                          "max_model_len": 512, **scheduler_kwargs})
    cache_config = CacheConfig(**{"block_size": BLOCK_SIZE, "num_blocks": 256, "enable_prefix_caching": True,
                                  **cache_kwargs})
    return LLMEngine(path, scheduler_config, cache_config, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_greedy_tokens_match_transformers(checkpoints, references, model_name, scenario, device):
    path, _ = checkpoints[model_name]
    engine = _engine(path, *SCENARIOS[scenario], device=device)
    params = SamplingParams(max_tokens=NUM_OUTPUT, ignore_eos=True)
    prompts = PROMPTS
    if scenario == "prefix_cache":
        engine.generate(PROMPTS, params)  # fills the prefix cache (PROMPTS[6:8] come back verbatim)
        engine.generate(PREFIX_PROMPTS[:1], params)  # caches the shared prefix's blocks
        prompts = PREFIX_PROMPTS
        hits_before = engine.counters.num_prefix_hit_tokens
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == references[model_name][tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert output.finish_reason is not None and output.finish_reason.value == "length"
    counters = engine.counters
    if scenario == "prefix_cache":
        # Shared 40-token prefix: 2 full blocks per request; repeated prompts hit every full block.
        assert counters.num_prefix_hit_tokens - hits_before >= 5 * 32 + (64 + 96)
    if scenario == "preemption":
        assert counters.num_preemptions > 0
    if scenario == "ngram_spec":
        assert counters.num_draft_tokens > 0
        assert counters.num_accepted_tokens > 0
    # Every block comes back once the requests are done.
    usage = engine.kv_usage()
    assert usage.num_free_blocks == usage.num_total_blocks


def _paged_logits(model, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits of every prompt position, computed chunk by chunk through the paged cache."""
    config = model.config
    num_blocks = -(-len(prompt) // BLOCK_SIZE) + 1
    caches = [
        (torch.zeros(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
         torch.zeros(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim))
        for _ in range(config.num_layers)
    ]
    # Blocks in reverse order, so a wrong block-table lookup cannot pass by accident.
    block_ids = torch.arange(num_blocks - 1, -1, -1)
    logits = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start:start + chunk]
            positions = torch.arange(start, start + len(ids))
            slots = block_ids[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
            meta = AttentionMetadata(
                slot_mapping=slots, num_decode_tokens=0, decode_block_table=None, decode_context_lens=None,
                decode_key_mask=None,
                spans=[SequenceSpan(0, len(ids), start + len(ids), block_ids[: -(-(start + len(ids)) // BLOCK_SIZE)])],
            )
            hidden = model(torch.tensor(ids), positions, caches, meta)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.parametrize("model_name", list(MODELS) + list(EXTRA_LOGIT_MODELS))
def test_prefill_logits_match_transformers(checkpoints, model_name):
    path, hf = checkpoints[model_name]
    model = load_model(path).model
    prompt = PROMPTS[-1]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].float()
    for chunk in (len(prompt), 7):
        torch.testing.assert_close(_paged_logits(model, prompt, chunk), reference, atol=2e-5, rtol=1e-4)


def test_prompt_logprobs_match_transformers(checkpoints):
    path, hf = checkpoints["llama"]
    engine = _engine(path, {"max_num_batched_tokens": 24}, {})
    prompt = PROMPTS[6]
    [output] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3))
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        row = reference[position]
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(row[prompt[position + 1]].item(), abs=1e-4)
        assert [token for token, _ in entry.top] == row.topk(3).indices.tolist()


def test_config_json_round_trip_and_variants():
    for config in {**MODELS, **EXTRA_LOGIT_MODELS}.values():
        parsed = ModelArchConfig.from_hf_dict(config.to_hf_dict())
        assert parsed.to_hf_dict() == config.to_hf_dict()
    # transformers v5 folds rope settings into rope_parameters.
    v5 = {**MODELS["llama"].to_hf_dict(), "rope_parameters": {"rope_theta": 5e5, **LLAMA3_SCALING}}
    del v5["rope_theta"], v5["rope_scaling"]
    parsed = ModelArchConfig.from_hf_dict(v5)
    assert parsed.rope_theta == 5e5 and parsed.rope_scaling == LLAMA3_SCALING
    # Sliding-window attention is implemented: the window is kept and the model length is not capped.
    mistral = {**EXTRA_LOGIT_MODELS["mistral"].to_hf_dict(), "sliding_window": 128}
    parsed_mistral = ModelArchConfig.from_hf_dict(mistral)
    assert parsed_mistral.sliding_window == 128 and parsed_mistral.max_position_embeddings == 512
    assert ModelArchConfig.from_hf_dict(MODELS["qwen2"].to_hf_dict()).attention_bias
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelArchConfig.from_hf_dict({**v5, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        yarn = {"rope_type": "yarn", "factor": 2.0}
        ModelArchConfig.from_hf_dict({**MODELS["llama"].to_hf_dict(), "rope_scaling": yarn})


# ---- layer_types: which layers slide, per model type, as transformers computes it ------------------------

FULL, SLIDING = "full_attention", "sliding_attention"
WINDOW = 8
LAYER_PROMPTS = [PROMPTS[4], PROMPTS[6]]  # 31 and 70 tokens: both past the window

# name -> (model_type, config.json fields over the saved ones, the layer types the engine must run).
# Each is written as config.json and read back by both transformers and the engine.
LAYER_TYPE_CASES = {
    # transformers reads a Mistral config with layer_types as Ministral: the window on the listed layers only.
    "mistral-full-then-sliding": ("mistral", {"sliding_window": WINDOW, "layer_types": [FULL, SLIDING]},
                                  (FULL, SLIDING)),
    "mistral-sliding-then-full": ("mistral", {"sliding_window": WINDOW, "layer_types": [SLIDING, FULL]},
                                  (SLIDING, FULL)),
    "mistral-all-full-with-window": ("mistral", {"sliding_window": WINDOW, "layer_types": [FULL, FULL]},
                                     (FULL, FULL)),
    "mistral-window-no-layer-types": ("mistral", {"sliding_window": WINDOW}, (SLIDING, SLIDING)),
    # Llama's attention has no window: a window with only full layers changes nothing.
    "llama-window-all-full": ("llama", {"sliding_window": WINDOW, "layer_types": [FULL, FULL]}, (FULL, FULL)),
    "qwen3-layer-types": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                                    "layer_types": [SLIDING, FULL]}, (SLIDING, FULL)),
    "qwen2-max-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                          "max_window_layers": 1, "layer_types": None}, (FULL, SLIDING)),
    # Without use_sliding_window Qwen2 ignores the window and the default layer types.
    "qwen2-window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": WINDOW, "max_window_layers": 0,
                                   "layer_types": None}, (FULL, FULL)),
}


def _write_config(path, **changes) -> None:
    """config.json with the fields changed (None removes one)."""
    config = {**json.loads((path / "config.json").read_text()), **changes}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.mark.slow
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", list(LAYER_TYPE_CASES))
def test_layer_types_slide_the_layers_transformers_slides(tmp_path, name):
    model_type, fields, expected = LAYER_TYPE_CASES[name]
    save_pretrained(random_model(ModelArchConfig(model_type=model_type, num_layers=2, **SMALL), seed=5), tmp_path)
    _write_config(tmp_path, **fields)
    config = ModelArchConfig.from_json_file(tmp_path / "config.json")
    assert config.layer_types == expected
    assert config.sliding_window == (WINDOW if SLIDING in expected else None)
    # What the engine writes back reads the same (a Mistral with mixed layers keeps its layer_types).
    assert ModelArchConfig.from_hf_dict(config.to_hf_dict()).layer_types == expected
    with one_torch_thread():
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
        references = [_hf_greedy(hf, p, 8) for p in LAYER_PROMPTS]
    engine = _engine(tmp_path, {"max_num_batched_tokens": 16}, {})  # chunked prefill, too
    outputs = engine.generate(LAYER_PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == references


# config.json fields transformers fails on, or runs with full attention on prefill and the window on decode
# (Llama: its cache keeps only the window, its attention has none): refused, naming the field.
LAYER_TYPE_REFUSALS = {
    "llama-window": ("llama", {"sliding_window": WINDOW}, "sliding_window 8 .* model_type llama"),
    "llama-sliding-layer": ("llama", {"sliding_window": WINDOW, "layer_types": [FULL, SLIDING]},
                            "not supported for model_type llama"),
    "llama-sliding-layer-no-window": ("llama", {"layer_types": [FULL, SLIDING]},
                                      "sliding_attention layers but sliding_window is absent or null"),
    "qwen2-sliding-layer-window-off": ("qwen2", {"sliding_window": WINDOW, "layer_types": [FULL, SLIDING]},
                                       "sliding_attention layers but use_sliding_window is false"),
    "mistral-layer-types-no-window": ("mistral", {"sliding_window": None, "layer_types": [FULL, FULL]},
                                      "layer_types needs a sliding_window"),
    "layer-types-length": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                                     "layer_types": [FULL]}, "layer_types has 1 entries for 2 layers"),
}


@pytest.mark.parametrize("name", list(LAYER_TYPE_REFUSALS))
def test_layer_types_transformers_cannot_run_consistently_are_refused(name):
    model_type, fields, message = LAYER_TYPE_REFUSALS[name]
    hf = {**ModelArchConfig(model_type=model_type, num_layers=2, **SMALL).to_hf_dict(), **fields}
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_dict(hf)
