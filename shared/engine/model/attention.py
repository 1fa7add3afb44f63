"""Paged attention over a block-table-indexed KV cache, for a mixed batch of prefill chunks and decodes.

Per layer the cache holds K and V as [num_blocks, block_size, num_kv_heads, head_dim]; token t of a
request lives in block block_table[t // block_size] at offset t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.model.paged_decode import paged_decode_attention


@dataclass
class SequenceSpan:
    """One request with more than one query token this step (a prefill chunk or a decode plus drafts)."""

    query_start: int  # first row of this request in the flattened batch
    query_len: int
    context_len: int  # tokens whose KV the queries see: computed before this step + query_len
    block_ids: torch.Tensor  # long [num_blocks_needed]: the blocks holding those context tokens


@dataclass
class AttentionMetadata:
    """How the flattened token batch maps onto requests and cache slots for one forward pass.

    Single-token requests (plain decodes) come first in the batch, rows [0, num_decode_tokens), and
    are served by one batched attention; longer spans follow, one attention call per span.
    """

    slot_mapping: torch.Tensor  # long [num_tokens]: flat cache slot each new token's KV goes to
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None  # long [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # long [num_decodes]
    # additive (0 / -inf) [num_decodes, 1, 1, max_blocks * block_size] for the gather + SDPA decode
    # path; None selects the paged decode kernel (the runner leaves it out when the kernel is built)
    decode_key_mask: torch.Tensor | None
    spans: list[SequenceSpan]
    # decode_key_mask for sliding-window layers (keys before the window masked too); set only for a
    # model with such layers on the gather + SDPA path
    decode_window_key_mask: torch.Tensor | None = None
    # The Triton kernels serve every row (the CUDA path; the runner sets it, see select_attention_backend)
    use_triton: bool = False
    span_batch: object | None = None  # triton_attention.SpanBatch of spans, built by the first layer


# The attention paths the runner chooses between once, at start-up.
CPU_DECODE_KERNEL = "cpu paged decode kernel"
TRITON = "triton"
GATHER_SDPA = "gather + SDPA"


def select_attention_backend(device_type: str, *, triton_available: bool, cpu_kernel_available: bool) -> str:
    """CUDA with Triton: the Triton kernels for every row; the CPU with its C++ decode kernel: that kernel
    for decodes; otherwise gather + SDPA for decodes. Spans take SDPA on every path but Triton's."""
    if device_type == "cuda" and triton_available:
        return TRITON
    if device_type == "cpu" and cpu_kernel_available:
        return CPU_DECODE_KERNEL
    return GATHER_SDPA


@dataclass
class OutputRows:
    """A subset of the batch's rows (ascending) and the attention metadata of just those rows.

    Decode rows are always all kept; a span keeps a suffix of its queries (its context is unchanged,
    so a partial suffix reads its keys back from the cache)."""

    rows: torch.Tensor  # long [num_kept]
    meta: AttentionMetadata


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K and V rows into their slots; a block is [block_size, kv_heads, head_dim]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (already written to the cache) -> output [T, H, D].

    sliding_window: the query at position i sees keys i - sliding_window + 1 .. i only (transformers'
    sliding-window mask); the cache still holds every key, so only the masks change."""
    if meta.use_triton:
        return _triton_attention(query, key_cache, value_cache, meta, scale, sliding_window)
    output = torch.empty_like(query)
    num_decode = meta.num_decode_tokens
    if num_decode:
        output[:num_decode] = _decode_attention(query[:num_decode], key_cache, value_cache, meta, scale,
                                                sliding_window)
    for run in _fresh_prompt_runs(meta.spans):
        rows = slice(run[0].query_start, run[-1].query_start + run[-1].query_len)
        output[rows] = _fresh_prompts_attention(query[rows], key[rows], value[rows], len(run), scale,
                                                sliding_window)
    for span in meta.spans:
        if _is_fresh_prompt(span):
            continue  # served above, batched with its run
        rows = slice(span.query_start, span.query_start + span.query_len)
        output[rows] = _span_attention(query[rows], key_cache, value_cache, span, scale, sliding_window)
    return output


def _triton_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Every row read from the cache (this step's K and V are already written): one decode launch
    for the decode rows, one prefill launch for all spans."""
    from shared.engine.model import triton_attention  # triton is optional: imported on this path only

    num_decode = meta.num_decode_tokens
    if num_decode and not meta.spans:
        # A decode-only step (what CUDA graphs replay): no copy into a combined output
        return triton_attention.decode_attention(query, key_cache, value_cache, meta.decode_block_table,
                                                 meta.decode_context_lens, scale, sliding_window)
    output = torch.empty_like(query)
    if num_decode:
        output[:num_decode] = triton_attention.decode_attention(
            query[:num_decode], key_cache, value_cache, meta.decode_block_table, meta.decode_context_lens,
            scale, sliding_window)
    if meta.spans:
        if meta.span_batch is None:
            meta.span_batch = triton_attention.span_batch(meta.spans, query.device,
                                                             triton_attention.prefill_tile(query.dtype))
        triton_attention.prefill_attention(query, key_cache, value_cache, meta.span_batch, scale,
                                           sliding_window, out=output)
    return output


def _additive_mask(query_positions: torch.Tensor, num_keys: int, sliding_window: int | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """[num_queries, num_keys]: 0 where the query at that position may see the key, -inf elsewhere
    (keys after it, and keys at or before position - sliding_window)."""
    key_positions = torch.arange(num_keys, device=query_positions.device).unsqueeze(0)
    query_positions = query_positions.unsqueeze(1)
    hidden = key_positions > query_positions
    if sliding_window is not None:
        hidden |= key_positions <= query_positions - sliding_window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill_(hidden, float("-inf"))


def _is_fresh_prompt(span: SequenceSpan) -> bool:
    """A whole prompt with no earlier context: it attends only to this step's own K and V."""
    return span.context_len == span.query_len


def _fresh_prompt_runs(spans: list[SequenceSpan]) -> list[list[SequenceSpan]]:
    """Adjacent spans that are whole fresh prompts (no earlier context) of one length, grouped: each
    group is one batched causal attention instead of a call per prompt (a 64-prompt prefill step
    otherwise pays 64 calls' fixed cost per layer)."""
    runs: list[list[SequenceSpan]] = []
    for span in spans:
        if not _is_fresh_prompt(span):
            continue
        last = runs[-1][-1] if runs else None
        if (last is not None and last.query_len == span.query_len
                and last.query_start + last.query_len == span.query_start):
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def _fresh_prompts_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             num_prompts: int, scale: float, sliding_window: int | None) -> torch.Tensor:
    """num_prompts equal-length prompts laid end to end: [N * L, heads, D] -> causal attention each."""
    total, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    prompt_len = total // num_prompts
    q = query.view(num_prompts, -1, num_heads, head_dim).transpose(1, 2)
    k = key.view(num_prompts, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = value.view(num_prompts, -1, num_kv_heads, head_dim).transpose(1, 2)
    if sliding_window is None or prompt_len <= sliding_window:
        # Within the window, sliding-window attention is plain causal attention.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        positions = torch.arange(prompt_len, device=query.device)
        mask = _additive_mask(positions, prompt_len, sliding_window, query.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(total, num_heads, head_dim)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    if meta.decode_key_mask is None:
        # The kernel reads each request's blocks in place, only up to its context length: no gather, no padding.
        return paged_decode_attention(query, key_cache, value_cache, meta.decode_block_table,
                                      meta.decode_context_lens, scale, sliding_window)
    key_mask = meta.decode_key_mask if sliding_window is None else meta.decode_window_key_mask
    if key_mask is None:
        raise ValueError("a sliding-window layer needs AttentionMetadata.decode_window_key_mask on this path")
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    # No kernel (another device, no compiler): gather each request's blocks (index_select copies
    # whole blocks: much faster than advanced indexing) into [B, S, KVH, D]; keys past a request's
    # context length are masked out.
    flat_table = meta.decode_block_table.flatten()
    keys = key_cache.index_select(0, flat_table).view(num_seqs, -1, num_kv_heads, head_dim)
    values = value_cache.index_select(0, flat_table).view(num_seqs, -1, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=key_mask, scale=scale, enable_gqa=True,
    )
    return out.view(num_seqs, num_heads, head_dim)


def _span_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    span: SequenceSpan, scale: float, sliding_window: int | None) -> torch.Tensor:
    """A span with earlier context (a later prefill chunk, a prefix-cache hit, a decode with drafts,
    or a kept suffix of queries): read the whole context back from the cache blocks."""
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_past = span.context_len - query_len
    q = query.transpose(0, 1).unsqueeze(0)
    k = key_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[: span.context_len]
    v = value_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[: span.context_len]
    k = k.transpose(0, 1).unsqueeze(0)
    v = v.transpose(0, 1).unsqueeze(0)
    # Query i sits at position num_past + i and may see keys 0..num_past + i (bottom-right causal).
    query_positions = torch.arange(num_past, span.context_len, device=query.device)
    mask = _additive_mask(query_positions, span.context_len, sliding_window, query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
