"""Checkpoint shapes beyond the basic Llama/Qwen2/Mistral ones, token for token against transformers on
the same random weights: attention and MLP biases, Qwen3's per-head q/k norms, sliding-window attention
with prompts longer than the window (plain, chunked prefill, prefix-cache hits, both decode attention
paths), small and odd head sizes, one KV head, and bfloat16.

Each engine test runs under a timeout: small head sizes used to make the decode kernel loop forever.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared.engine.kv_transfer.connector import KVRole  # noqa: E402
from shared.engine.kv_transfer.handoff import HoldForPeer  # noqa: E402
from loopback_connector import LoopbackConnector, LoopbackKVStore  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.model import attention  # noqa: E402
from shared.engine.model.loader import random_model, save_pretrained  # noqa: E402
from shared.engine.model.model_config import ModelArchConfig  # noqa: E402
from shared.engine.request import Request, SamplingParams  # noqa: E402
from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402

NUM_OUTPUT = 12
BLOCK_SIZE = 8
WINDOW = 20
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None)


def _config(**overrides) -> ModelArchConfig:
    return ModelArchConfig(**{**SMALL, **overrides})


SHAPES = {
    "llama-attention-and-mlp-bias": _config(attention_bias=True, mlp_bias=True),
    "qwen3": _config(model_type="qwen3", head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3-bias-tied": _config(model_type="qwen3", attention_bias=True, tie_word_embeddings=True),
    "mistral-sliding-window": _config(model_type="mistral", sliding_window=WINDOW),
    # The first layer full, the second sliding (Qwen2's max_window_layers = 1).
    "qwen2-sliding-window": _config(model_type="qwen2", sliding_window=WINDOW,
                                    layer_types=("full_attention", "sliding_attention")),
    "qwen3-sliding-window": _config(model_type="qwen3", sliding_window=WINDOW,
                                    layer_types=("sliding_attention", "sliding_attention")),
    # head_dim x 4 bytes under 64: the decode kernel's prefetcher used to stall on these.
    "llama-head-dim-8": _config(hidden_size=32, num_heads=4, num_kv_heads=2),
    "llama-head-dim-12-one-kv-head": _config(hidden_size=48, num_heads=4, num_kv_heads=1),
    "mistral-one-kv-head": _config(model_type="mistral", num_kv_heads=1),
}

_rng = random.Random(99)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (5, 19, 21, 45, 70)]
_prefix = [_rng.randrange(256) for _ in range(40)]
PREFIX_PROMPTS = [_prefix + [_rng.randrange(256) for _ in range(n)] for n in (3, 30)]


def _save(config: ModelArchConfig, path) -> transformers.PreTrainedModel:
    save_pretrained(random_model(config, seed=11), path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=config.torch_dtype).eval()


def _hf_greedy(hf, prompt: list[int], num_tokens: int = NUM_OUTPUT) -> list[int]:
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (model dir, {prompt: transformers' greedy tokens})."""
    out = {}
    with one_torch_thread():
        for name, config in SHAPES.items():
            path = tmp_path_factory.mktemp(name)
            hf = _save(config, path)
            prompts = PROMPTS + PREFIX_PROMPTS if config.has_sliding_window else PROMPTS
            out[name] = (path, {tuple(p): _hf_greedy(hf, p) for p in prompts})
    return out


def _engine(path, max_num_batched_tokens: int = 512, dtype: str | None = None, connector=None) -> LLMEngine:
    return LLMEngine(path, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                           max_model_len=256),
                     CacheConfig(block_size=BLOCK_SIZE, num_blocks=128, enable_prefix_caching=True), dtype=dtype,
                     connector=connector)


def _check(engine: LLMEngine, prompts, references) -> None:
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NUM_OUTPUT, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == references[tuple(prompt)], f"prompt of {len(prompt)} tokens"


@pytest.mark.slow
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_tokens_match_transformers(checkpoints, name):
    path, references = checkpoints[name]
    _check(_engine(path), PROMPTS, references)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", ["mistral-sliding-window", "qwen2-sliding-window"])
def test_sliding_window_under_chunked_prefill_and_prefix_hits(checkpoints, name):
    path, references = checkpoints[name]
    engine = _engine(path, max_num_batched_tokens=16)  # every prompt longer than the window is chunked
    _check(engine, PROMPTS, references)
    _check(engine, PREFIX_PROMPTS[:1], references)
    hits_before = engine.counters.num_prefix_hit_tokens
    _check(engine, PREFIX_PROMPTS, references)
    assert engine.counters.num_prefix_hit_tokens - hits_before >= 2 * 40 // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", ["mistral-sliding-window", "qwen2-sliding-window"])
def test_sliding_window_across_a_prefill_decode_handoff(checkpoints, name):
    """The decode side pulls the prompt's whole KV (as a prefill pod hands it over) and its masks keep
    each query inside the window, so split serving gives transformers' tokens too."""
    path, references = checkpoints[name]
    store = LoopbackKVStore()
    producer = _engine(path, connector=LoopbackConnector(KVRole.PRODUCER, store, "prefill", block_size=BLOCK_SIZE))
    consumer = _engine(path, connector=LoopbackConnector(KVRole.CONSUMER, store, "decode", block_size=BLOCK_SIZE))
    prompts = PROMPTS[2:]  # all longer than the window
    for i, prompt in enumerate(prompts):
        producer.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), None,
                                     kv_transfer_params=HoldForPeer()))
    handles = {}
    while producer.has_unfinished_requests():
        for out in producer.step():
            if out.finished:
                handles[out.request_id] = (out.new_token_ids[0], out.kv_handle)
    tokens = {}
    for i, prompt in enumerate(prompts):
        first, handle = handles[f"p{i}"]
        tokens[f"d{i}"] = [first]
        consumer.add_request(Request(f"d{i}", prompt + [first], SamplingParams(max_tokens=NUM_OUTPUT - 1,
                                     ignore_eos=True), None, kv_transfer_params=handle))
    while consumer.has_unfinished_requests() or consumer.has_pending_kv_work():
        for out in consumer.step():
            tokens[out.request_id].extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert tokens[f"d{i}"] == references[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    assert consumer.counters.num_scheduled_tokens == len(prompts) * (NUM_OUTPUT - 1)  # no prompt recomputed


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", ["mistral-sliding-window", "qwen2-sliding-window", "llama-head-dim-8"])
def test_gather_decode_path_matches_too(checkpoints, name, monkeypatch):
    """Without the C++ kernel (another device, no compiler) decodes take the gather + SDPA path."""
    path, references = checkpoints[name]
    engine = _engine(path)
    monkeypatch.setattr(engine.runner, "_uses_decode_kernel", False)
    calls = []
    original = attention.paged_decode_attention
    monkeypatch.setattr(attention, "paged_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    _check(engine, PROMPTS, references)
    assert not calls


def _hf_greedy_with_logits(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and, per step, its logits (as generate() reads them: float32 copies)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NUM_OUTPUT, min_new_tokens=NUM_OUTPUT, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


def _bfloat16_step(value: float) -> float:
    """The distance between adjacent bfloat16 numbers at value's magnitude (8 significant bits)."""
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8)


def _assert_same_or_bfloat16_tie(ours: list[int], theirs: list[int], logits: list[torch.Tensor], what: str) -> None:
    """Our tokens are transformers' tokens; or they are up to a step where transformers' own logits for
    the two chosen tokens are at most one bfloat16 step apart: a tie under transformers' own rounding
    (its eager and SDPA attentions differ by up to two steps on these logits), so either token is its
    answer. After that step the contexts differ and nothing more is comparable."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None:
        return
    step = logits[first]
    mine, its = step[ours[first]].item(), step[theirs[first]].item()
    tie = _bfloat16_step(max(abs(mine), abs(its)))
    assert its - mine <= tie, (f"{what}: token {first} is {ours[first]} (transformers' logit {mine}), transformers "
                               f"chose {theirs[first]} ({its}): {its - mine} apart, more than one bfloat16 step ({tie})")


@pytest.mark.slow
@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("head_dim", [8, 12])
def test_bfloat16_small_head_sizes_match_transformers(tmp_path, head_dim):
    """bfloat16 against transformers' SDPA attention (its default) and its eager one. The prefill's logits
    are bit-identical to SDPA's (same op order: float32 RMSNorm, bfloat16 rope tables computed in float32,
    torch's SDPA, bfloat16 LM head). Decode attention accumulates in its own order (the kernel; the
    gather + SDPA path pads the keys), so a decode step's logits may differ by a bfloat16 step or two,
    as transformers' eager and SDPA logits differ from each other: every prompt must give transformers'
    tokens or differ first at a bfloat16 tie (_assert_same_or_bfloat16_tie), on both decode paths.
    Measured (head_dim 8, the 5-token prompt, step 6): tokens 14 and 177 have equal logits under eager
    (0.2412109375 each) and one step apart under SDPA (0.2412109375 and 0.2421875); eager picks 14, SDPA
    177, and so do our two decode paths, one each."""
    config = _config(hidden_size=4 * head_dim, num_heads=4, num_kv_heads=1, dtype="bfloat16")
    with one_torch_thread():
        save_pretrained(random_model(config, seed=11), tmp_path)
        references = {}
        for implementation in ("sdpa", "eager"):
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path, attn_implementation=implementation, dtype=torch.bfloat16).eval()
            references[implementation] = [_hf_greedy_with_logits(hf, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NUM_OUTPUT, ignore_eos=True)
    for uses_kernel in (True, False):
        engine = _engine(tmp_path, dtype="bfloat16")
        engine.runner._uses_decode_kernel = uses_kernel
        logit_calls = []
        compute_logits = engine.loaded.model.compute_logits
        engine.loaded.model.compute_logits = lambda h: logit_calls.append(compute_logits(h)) or logit_calls[-1]
        outputs = engine.generate(PROMPTS, params)
        prefill_logits = logit_calls[0]  # the first step prefills every prompt, one row each in order
        for index, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
            sdpa_logits = references["sdpa"][index][1]
            assert torch.equal(prefill_logits[index], sdpa_logits[0]), f"prefill logits, prompt of {len(prompt)}"
            for implementation, per_prompt in references.items():
                tokens, logits = per_prompt[index]
                _assert_same_or_bfloat16_tie(output.token_ids, tokens, logits,
                                             f"{implementation}, decode kernel {uses_kernel}, prompt of {len(prompt)}")


def test_model_length_is_not_capped_at_the_window():
    """The model length is no longer capped at the window: a Mistral checkpoint keeps its positions."""
    config = ModelArchConfig.from_hf_dict({**SHAPES["mistral-sliding-window"].to_hf_dict(),
                                           "max_position_embeddings": 4096})
    assert config.max_position_embeddings == 4096 and config.sliding_window == WINDOW
