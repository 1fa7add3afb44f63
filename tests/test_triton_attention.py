"""The Triton paged-attention kernels (the CUDA path) against a float64 reference, run on the CPU in
Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU; with one they run compiled):
decode rows with ragged contexts and split-K, prefill spans with cached prefixes, GQA ratios, block
sizes, bfloat16 and float32, sliding windows, paged_attention's mixed batches through the Triton path,
and whole engine runs on it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# The slow lane: without a GPU every kernel runs in Triton's interpreter, a Python loop over its program
# instances (the whole-engine runs take seconds each); this file was half of the fast lane's time.
pytestmark = pytest.mark.e2e

from shared.engine.model import triton_attention  # noqa: E402
from shared.engine.model.attention import AttentionMetadata, SequenceSpan, paged_attention  # noqa: E402

HEAD_DIM = 16
# Compiled kernels need CUDA tensors; without a GPU, conftest has the interpreter run them on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_cache(num_blocks, block_size, num_kv_heads, dtype, seed, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def block_tables(context_lens, block_size, num_blocks, seed):
    """Each sequence gets distinct, shuffled blocks (never block 0, the padding block)."""
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for length in context_lens:
        count = -(-length // block_size)
        tables.append([free.pop() for _ in range(count)])
    return tables


def reference(query, key_cache, value_cache, table, context_len, query_positions, scale, window):
    """float64 attention of queries [Q, H, D] at query_positions over a sequence's first context_len keys."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(context_len)])
    keys = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
    values = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
    group = query.shape[1] // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    key_pos = torch.arange(context_len).unsqueeze(0)
    q_pos = torch.tensor(query_positions).unsqueeze(1)
    hidden = key_pos > q_pos
    if window is not None:
        hidden |= key_pos <= q_pos - window
    scores = scores.masked_fill(hidden.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def check_decode(context_lens, num_heads, num_kv_heads, block_size, dtype, window=None, num_splits=None,
                 block_n=16, seed=0, device=DEVICE, head_dim=HEAD_DIM):
    """The kernel on device (a GPU for test_gpu_path) against the float64 reference on the CPU."""
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    key_cache, value_cache = make_cache(num_blocks, block_size, num_kv_heads, dtype, seed, head_dim)
    tables = block_tables(context_lens, block_size, num_blocks, seed)
    width = max(len(t) for t in tables) + 1  # wider than needed: the kernel must stop at the context
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    query = query.to(dtype)
    scale = head_dim ** -0.5
    out = triton_attention.decode_attention(
        query.to(device), key_cache.to(device), value_cache.to(device), table.to(device),
        torch.tensor(context_lens, device=device), scale, window, num_splits=num_splits, block_n=block_n).cpu()
    assert out.dtype == dtype and out.shape == query.shape
    for b, length in enumerate(context_lens):
        expected = reference(query[b:b + 1], key_cache, value_cache, tables[b], length, [length - 1], scale, window)
        torch.testing.assert_close(out[b:b + 1].double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged_contexts(dtype, num_splits):
    check_decode([1, 7, 16, 45], num_heads=4, num_kv_heads=2, block_size=4, dtype=dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_decode_gqa_ratios(num_heads, num_kv_heads):
    check_decode([5, 33], num_heads, num_kv_heads, block_size=8, dtype=torch.float32, num_splits=2)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_block_sizes(block_size):
    check_decode([3, 40], num_heads=4, num_kv_heads=2, block_size=block_size, dtype=torch.float32, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits):
    # Windows shorter than, equal to and longer than the contexts.
    check_decode([2, 9, 30, 41], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, window=9,
                 num_splits=num_splits)


def test_decode_split_counts_out_of_range_are_refused():
    with pytest.raises(ValueError, match="num_splits"):
        check_decode([4], num_heads=2, num_kv_heads=1, block_size=4, dtype=torch.float32, num_splits=17)


def test_decode_more_splits_than_key_tiles():
    # Most splits of the short sequences are empty: the reduction must ignore them.
    check_decode([1, 2, 20], num_heads=2, num_kv_heads=1, block_size=4, dtype=torch.float32, num_splits=8)


def test_decode_num_splits_fills_the_gpu_and_no_more():
    assert triton_attention.decode_num_splits(1, 8, max_keys=1024, num_sms=132) == 16  # capped
    assert triton_attention.decode_num_splits(1, 8, max_keys=64, num_sms=132) == 1  # one key tile
    assert triton_attention.decode_num_splits(16, 8, max_keys=4096, num_sms=132) == 4
    assert triton_attention.decode_num_splits(32, 8, max_keys=2048, num_sms=132) == 2
    assert triton_attention.decode_num_splits(128, 8, max_keys=1024, num_sms=132) == 1


def check_spans(spans, num_heads, num_kv_heads, block_size, dtype, window=None, block_m=16, block_n=16, seed=0,
                device=DEVICE, head_dim=HEAD_DIM):
    """spans: (query_len, context_len) per span; each span's keys are already in the cache."""
    contexts = [context for _, context in spans]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    key_cache, value_cache = make_cache(num_blocks, block_size, num_kv_heads, dtype, seed, head_dim)
    tables = block_tables(contexts, block_size, num_blocks, seed)
    total = sum(q for q, _ in spans)
    query = torch.randn(total, num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    seq_spans, start = [], 0
    for (query_len, context_len), table in zip(spans, tables):
        seq_spans.append(SequenceSpan(start, query_len, context_len, torch.tensor(table, device=device)))
        start += query_len
    # block_m None: the engine's tile for this dtype; small tiles keep the interpreter quick.
    tile = triton_attention.prefill_tile(dtype)
    if block_m is not None:
        tile = triton_attention.PrefillTile(block_m=block_m, num_warps=tile.num_warps)
    batch = triton_attention.span_batch(seq_spans, torch.device(device), tile)
    scale = head_dim ** -0.5
    out = triton_attention.prefill_attention(query.to(device), key_cache.to(device), value_cache.to(device), batch,
                                             scale, window, block_n=block_n).cpu()
    for span, table in zip(seq_spans, tables):
        rows = slice(span.query_start, span.query_start + span.query_len)
        positions = list(range(span.context_len - span.query_len, span.context_len))
        expected = reference(query[rows], key_cache, value_cache, table, span.context_len, positions, scale, window)
        torch.testing.assert_close(out[rows].double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fresh_prompts_and_prefix_hits(dtype):
    # Fresh prompts (context == query), prefix-cache hits and later chunks (context > query),
    # a decode with drafts (3 of 20), spans longer than one query tile and one key tile.
    check_spans([(5, 5), (37, 37), (12, 30), (3, 20), (20, 53)], num_heads=4, num_kv_heads=2, block_size=4,
                dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 8), (8, 2, 16), (6, 1, 1)])
def test_prefill_gqa_ratios_and_block_sizes(num_heads, num_kv_heads, block_size):
    check_spans([(18, 18), (9, 25)], num_heads, num_kv_heads, block_size, torch.float32)


@pytest.mark.parametrize("window", [1, 7, 16])
def test_prefill_sliding_window(window):
    check_spans([(40, 40), (10, 35), (4, 4)], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32,
                window=window)


def test_paged_attention_mixed_batch_takes_the_triton_path():
    """Decode rows first, then spans: one paged_attention call with use_triton matches the reference
    for every row (the runner's batch layout)."""
    num_heads, num_kv_heads, block_size, dtype = 4, 2, 4, torch.float32
    decode_contexts = [1, 13, 26]
    spans = [(9, 9), (6, 22)]
    contexts = decode_contexts + [c for _, c in spans]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    key_cache, value_cache = make_cache(num_blocks, block_size, num_kv_heads, dtype, seed=3)
    tables = block_tables(contexts, block_size, num_blocks, seed=3)
    num_rows = len(decode_contexts) + sum(q for q, _ in spans)
    query = torch.randn(num_rows, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    width = max(len(t) for t in tables[:3])
    seq_spans, start = [], len(decode_contexts)
    for (query_len, context_len), table in zip(spans, tables[3:]):
        seq_spans.append(SequenceSpan(start, query_len, context_len, torch.tensor(table, device=DEVICE)))
        start += query_len
    meta = AttentionMetadata(
        slot_mapping=None, num_decode_tokens=len(decode_contexts),
        decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]], device=DEVICE),
        decode_context_lens=torch.tensor(decode_contexts, device=DEVICE), decode_key_mask=None, spans=seq_spans,
        use_triton=True,
    )
    scale = HEAD_DIM ** -0.5
    # key/value rows are unused on this path: everything is read back from the cache
    out = paged_attention(query.to(DEVICE), None, None, key_cache.to(DEVICE), value_cache.to(DEVICE), meta,
                          scale).cpu()
    for b, length in enumerate(decode_contexts):
        expected = reference(query[b:b + 1], key_cache, value_cache, tables[b], length, [length - 1], scale, None)
        torch.testing.assert_close(out[b:b + 1].double(), expected, atol=2e-5, rtol=2e-5)
    for span, table in zip(seq_spans, tables[3:]):
        rows = slice(span.query_start, span.query_start + span.query_len)
        positions = list(range(span.context_len - span.query_len, span.context_len))
        expected = reference(query[rows], key_cache, value_cache, table, span.context_len, positions, scale, None)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=2e-5)
    assert meta.span_batch is not None  # built once, reused by the next layers


def test_head_dim_128_as_in_the_presets():
    check_decode([5, 70], num_heads=4, num_kv_heads=1, block_size=16, dtype=torch.bfloat16, num_splits=2,
                 head_dim=128)
    check_spans([(20, 20), (7, 40)], num_heads=4, num_kv_heads=1, block_size=16, dtype=torch.bfloat16,
                head_dim=128)


@pytest.mark.parametrize("model_type,window,graphs", [("llama", None, False), ("mistral", 12, True)])
def test_engine_on_the_triton_path_matches_the_cpu_path(model_type, window, graphs, monkeypatch):
    """Whole requests through LLMEngine with the runner switched to the Triton path (interpreted here):
    chunked prefills, prefix-cache hits, n-gram drafts, decodes (also on the graphs' static buffers)
    and a sliding window give the tokens and logprobs of the CPU path."""
    if DEVICE != "cpu":
        pytest.skip("the CPU comparison runs where the kernels are interpreted (test_gpu_path covers CUDA)")
    import random

    from shared.engine.llm_engine import LLMEngine
    from shared.engine.model.cuda_graphs import DecodeGraphs
    from shared.engine.model.generation_config import generation_defaults
    from shared.engine.model.loader import LoadedModel, random_model
    from shared.engine.model.model_config import ModelArchConfig
    from shared.engine.request import SamplingParams
    from shared.engine.model import runner as runner_module
    from shared.engine.sched_config import CacheConfig, SchedulerConfig

    # The reference: the gather + SDPA path (no C++ kernel to load: this test stays quick)
    monkeypatch.setattr(runner_module, "paged_decode_available", lambda *args: False)
    config = ModelArchConfig(model_type=model_type, vocab_size=300, hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             sliding_window=window, eos_token_id=None, bos_token_id=None)
    loaded = LoadedModel(config, random_model(config, seed=7), None, generation_defaults((), None))
    rng = random.Random(1)
    shared_prefix = [rng.randrange(300) for _ in range(20)]
    prompts = [shared_prefix + [rng.randrange(300) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts.append([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6])  # repetitive: the n-gram proposer drafts
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=1)
              for i in range(len(prompts))]

    def run(triton_path):
        scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256,
                                    num_speculative_tokens=2, speculative_method="ngram")
        engine = LLMEngine(loaded, scheduler, CacheConfig(block_size=4, num_blocks=200), cuda_graphs=False)
        runner = engine.runner
        if triton_path:
            runner._uses_triton = True
            if graphs:
                runner.decode_graphs = DecodeGraphs(runner.model, runner.layer_kv, 256 // 4, runner.device,
                                                    use_triton=True, capture=False, batch_sizes=(1, 2, 4, 8))
                original = runner.decode_graphs.run
                runner.decode_graphs.run = lambda *args: graph_steps.append(1) or original(*args)
        outputs = engine.generate(prompts, params)
        return [out.token_ids for out in outputs], [[e.logprob for e in out.logprobs] for out in outputs]

    graph_steps = []
    expected, actual = run(False), run(True)
    assert bool(graph_steps) == graphs
    assert actual[0] == expected[0]
    for got, want in zip(actual[1], expected[1]):
        assert got == pytest.approx(want, abs=1e-4)
