"""paged_attention's batching and fallbacks against per-request reference attention: runs of
equal-length fresh prompts share one causal call, and decodes without the C++ kernel take the
gather + SDPA path."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shared.engine.model import attention
from shared.engine.model.attention import AttentionMetadata, SequenceSpan, paged_attention
from shared.engine.model.paged_decode import paged_decode_available

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 4
SCALE = HEAD_DIM ** -0.5


def causal_reference(query, key, value):
    """One prompt, [L, H, D] queries over its own [L, KVH, D] keys, causal."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def test_fresh_prompt_runs_group_adjacent_equal_lengths():
    spans = [SequenceSpan(query_start=start, query_len=length, context_len=context, block_ids=torch.zeros(1))
             for start, length, context in [(0, 5, 5), (5, 5, 5), (10, 3, 3), (13, 5, 5), (18, 2, 9), (20, 5, 5)]]
    runs = attention._fresh_prompt_runs(spans)
    # The span with earlier context (18: 2 of 9) is not fresh and splits nothing it is not adjacent to.
    assert [[span.query_start for span in run] for run in runs] == [[0, 5], [10], [13], [20]]


@pytest.mark.slow
def test_prefill_batch_matches_each_prompt_alone():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 5, 5, 3, 7, 7]
    total = sum(lengths)
    query = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    cache = torch.zeros(16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    spans, start = [], 0
    for length in lengths:
        spans.append(SequenceSpan(query_start=start, query_len=length, context_len=length, block_ids=torch.zeros(1)))
        start += length
    meta = AttentionMetadata(slot_mapping=None, num_decode_tokens=0, decode_block_table=None,
                             decode_context_lens=None, decode_key_mask=None, spans=spans)
    out = paged_attention(query, key, value, cache, cache, meta, SCALE)
    for span in spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        torch.testing.assert_close(out[rows], causal_reference(query[rows], key[rows], value[rows]))


@pytest.mark.skipif(not paged_decode_available(), reason="paged decode kernel could not be built here")
def test_decode_fallback_matches_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    contexts = [1, 4, 9, 13]
    width = 4
    key_cache = torch.randn(20, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value_cache = torch.randn(20, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(20, generator=gen)[: len(contexts) * width].view(len(contexts), width)
    lens = torch.tensor(contexts)
    query = torch.randn(len(contexts), NUM_HEADS, HEAD_DIM, generator=gen)
    invalid = torch.arange(width * BLOCK_SIZE).unsqueeze(0) >= lens.unsqueeze(1)
    mask = torch.zeros(invalid.shape).masked_fill_(invalid, float("-inf")).view(len(contexts), 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=None, num_decode_tokens=len(contexts), decode_block_table=table,
                             decode_context_lens=lens, decode_key_mask=mask, spans=[])
    empty = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)
    without_mask = dataclasses.replace(meta, decode_key_mask=None)  # selects the kernel
    with_kernel = paged_attention(query, empty, empty, key_cache, value_cache, without_mask, SCALE)
    monkeypatch.setattr(attention, "paged_decode_attention", None)  # a call to the kernel now fails
    with_sdpa = paged_attention(query, empty, empty, key_cache, value_cache, meta, SCALE)
    torch.testing.assert_close(with_kernel, with_sdpa)
