"""Paged attention as Triton kernels (the CUDA path): split-K decode over block tables, with the query
heads of one KV head packed together (GQA), and a tiled causal kernel for prefill spans that reads
every key, cached prefix included, straight from the cache blocks.

Triton is optional: without it triton_available() is False and the runner keeps another path. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (how the test suite checks them).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the runner never selects this path
    triton = None
    tl = None

# Every key lives at block_table[t // block_size] * block_size + t % block_size; the kernels gather
# key rows of BLOCK_N tokens at a time, so any block size works.
_DECODE_BLOCK_N = 64
_PREFILL_BLOCK_N = 64
_MAX_DECODE_SPLITS = 16
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows, columns and inner size
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dots_in_float32(dtype: torch.dtype) -> bool:
    # The interpreter's bfloat16 tl.dot returns garbage (triton 3.9), so it multiplies in float32;
    # float32 models multiply in full float32 (not TF32) to keep their fidelity to the reference.
    return dtype == torch.float32 or _interpreting()


@dataclass(frozen=True)
class PrefillTile:
    """Queries per prefill program, and the warps that run it."""

    block_m: int
    num_warps: int


def prefill_tile(dtype: torch.dtype) -> PrefillTile:
    """Half-precision tiles multiply on tensor cores: 64 queries over 4 warps. float32 ones multiply in
    full precision on the FMA units, where 64 queries over 4 warps need more than a thread's 255
    registers and spill (ptxas for sm_90, scripts/kernel_aot_check.py); 32 over 8 warps do not."""
    if dtype == torch.float32:
        return PrefillTile(block_m=32, num_warps=8)
    return PrefillTile(block_m=64, num_warps=4)


def _pow2_at_least(n: int, floor: int = _MIN_DOT_ROWS) -> int:
    return max(floor, triton.next_power_of_2(n))


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 8  # the interpreter: any value works; a small one keeps several splits in the tests
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_keys: int, num_sms: int,
                      block_n: int = _DECODE_BLOCK_N) -> int:
    """How many parts each sequence's keys are split into so the decode fills the GPU: about four
    programs per SM (enough warps in flight to hide memory latency), no more parts than key tiles.
    Depends only on shapes known without a device sync (max_keys: the block table's width in tokens),
    so a captured CUDA graph keeps it."""
    programs = num_seqs * num_kv_heads
    wanted = max(1, (4 * num_sms) // max(programs, 1))
    tiles = max(1, -(-max_keys // block_n))
    return min(wanted, tiles, _MAX_DECODE_SPLITS)


if triton is not None:

    @triton.jit
    def _dot(a, b, IN_F32: tl.constexpr):
        if IN_F32:
            product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            product = tl.dot(a, b)
        return product

    @triton.jit
    def _attend_key_tile(q, acc, row_max, row_sum, k_ptr, v_ptr, table_row_ptr, tokens, token_ok, visible, d, d_ok,
                         kv_head, scale_log2, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE: tl.constexpr, IN_F32: tl.constexpr):
        """One tile of keys for the online softmax of both kernels: gather its K and V rows through the
        block table, score the visible ones, rescale. Returns (acc, row_max, row_sum)."""
        blocks = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=token_ok, other=0)
        rows = blocks.to(tl.int64) * stride_cb + (tokens % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = token_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), IN_F32) * scale_log2
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row may see nothing in this tile (before its window, or a padding row): keep it at 0.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, IN_F32)
        return acc, new_max, row_sum

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        scale_log2, num_splits,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb, stride_ob, stride_oh,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, WRITES_OUTPUT: tl.constexpr,
        IN_F32: tl.constexpr,
    ):
        """One (sequence, KV head, split): the GROUP query heads of that KV head over one part of the
        sequence's keys. With one split (WRITES_OUTPUT) it writes the output; otherwise unnormalised
        partials. num_splits is a runtime value: a new split count compiles nothing new."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(lens_ptr + seq).to(tl.int32)
        first_key = 0
        if WINDOW > 0:
            first_key = tl.maximum(context_len - WINDOW, 0)
        keys_per_split = tl.cdiv(tl.cdiv(context_len - first_key, num_splits), BLOCK_N) * BLOCK_N
        lo = first_key + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, context_len)

        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        head_ok = g < GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=head_ok[:, None] & d_ok[None, :], other=0.0)
        row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            token_ok = tokens < hi
            acc, row_max, row_sum = _attend_key_tile(
                q, acc, row_max, row_sum, k_ptr, v_ptr, table_ptr + seq * stride_tb, tokens, token_ok,
                token_ok[None, :], d, d_ok, kv_head, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, IN_F32)

        store_mask = head_ok[:, None] & d_ok[None, :]
        if WRITES_OUTPUT:
            out = acc / row_sum[:, None]
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            # partials are [B, H, num_splits(, D)], contiguous
            part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
            tl.store(part_max_ptr + part, row_max, mask=head_ok)
            tl.store(part_sum_ptr + part, row_sum, mask=head_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=store_mask)

    @triton.jit
    def _decode_reduce_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, stride_ob, stride_oh, num_heads, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """One (sequence, head): merge its splits' partial softmaxes (an empty split has max -inf)."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        part = (seq * num_heads + head) * num_splits + s
        maxes = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
        overall = tl.max(maxes, 0)
        weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - overall))
        accs = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                       other=0.0)
        out = tl.sum(accs * weights[:, None], 0) / tl.sum(sums * weights, 0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tile_span_ptr, tile_row_ptr, query_start_ptr, query_len_ptr,
        context_len_ptr, table_ptr, scale_log2,
        stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, IN_F32: tl.constexpr,
    ):
        """One (tile of BLOCK_M queries of one span, query head): bottom-right causal attention over
        the span's context (its cached prefix and this step's keys, all already in the cache)."""
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        span = tl.load(tile_span_ptr + tile)
        first_row = tl.load(tile_row_ptr + tile)
        query_start = tl.load(query_start_ptr + span)
        query_len = tl.load(query_len_ptr + span)
        context_len = tl.load(context_len_ptr + span)
        num_past = context_len - query_len

        m = first_row + tl.arange(0, BLOCK_M)
        row_ok = m < query_len
        positions = num_past + m
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        tokens_q = (query_start + m).to(tl.int64)
        q = tl.load(q_ptr + tokens_q[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past the tile's last query are hidden to all its rows; so are keys before the first
        # row's window.
        hi = tl.minimum(context_len, num_past + first_row + BLOCK_M)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(num_past + first_row - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            token_ok = tokens < hi
            visible = (tokens[None, :] <= positions[:, None]) & token_ok[None, :]
            if WINDOW > 0:
                visible = visible & (tokens[None, :] > positions[:, None] - WINDOW)
            acc, row_max, row_sum = _attend_key_tile(
                q, acc, row_max, row_sum, k_ptr, v_ptr, table_ptr + span * stride_tb, tokens, token_ok, visible,
                d, d_ok, kv_head, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, IN_F32)

        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + tokens_q[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, num_splits: int | None = None,
                     block_n: int = _DECODE_BLOCK_N) -> torch.Tensor:
    """query [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_table [B, W]; context_lens [B]
    (each >= 1) -> [B, H, D]. Same contract as paged_decode.paged_decode_attention. num_splits: None
    picks decode_num_splits() from the shapes (no device sync, so CUDA graphs can capture it)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, block_table.shape[1] * block_size,
                                       _num_sms(query.device.index), block_n)
    if not 1 <= num_splits <= _MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_DECODE_SPLITS}], got {num_splits}")
    group = num_heads // num_kv_heads
    parts = (num_seqs, num_heads, num_splits)
    # With one split the partials are never written: a one-element placeholder stands in.
    part_shape = parts if num_splits > 1 else (1, 1, 1)
    part_acc = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=query.device)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    block_d = _pow2_at_least(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_table, context_lens, out, part_acc, part_max, part_sum,
        scale * _LOG2E, num_splits,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=_pow2_at_least(group), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, WINDOW=sliding_window or 0, WRITES_OUTPUT=num_splits == 1,
        IN_F32=_dots_in_float32(query.dtype),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(_MAX_DECODE_SPLITS),
        )
    return out


@dataclass
class SpanBatch:
    """The spans of one AttentionMetadata as device tensors, and the (span, first query row) of each
    BLOCK_M-query tile; built once per forward pass, read by every layer."""

    query_starts: torch.Tensor  # int32 [S]
    query_lens: torch.Tensor  # int32 [S]
    context_lens: torch.Tensor  # int32 [S]
    block_table: torch.Tensor  # [S, max_blocks], padded with block 0
    tile_spans: torch.Tensor  # int32 [num_tiles]
    tile_rows: torch.Tensor  # int32 [num_tiles]
    tile: PrefillTile


def span_batch(spans, device: torch.device, tile: PrefillTile) -> SpanBatch:
    """spans: attention.SequenceSpan list (host ints, block_ids tensors on device); tile: prefill_tile()
    of the model's dtype (or any, in tests)."""
    block_m = tile.block_m
    starts = [span.query_start for span in spans]
    lens = [span.query_len for span in spans]
    contexts = [span.context_len for span in spans]
    tile_spans, tile_rows = [], []
    for i, length in enumerate(lens):
        for row in range(0, length, block_m):
            tile_spans.append(i)
            tile_rows.append(row)
    table = torch.nn.utils.rnn.pad_sequence([span.block_ids for span in spans], batch_first=True)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return SpanBatch(ints(starts), ints(lens), ints(contexts), table.to(device), ints(tile_spans),
                     ints(tile_rows), tile)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      batch: SpanBatch, scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None, block_n: int = _PREFILL_BLOCK_N) -> torch.Tensor:
    """query [T, H, D] -> attention of the spans' rows (written into out, rows outside spans untouched)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(query)
    num_tiles = batch.tile_spans.shape[0]
    if num_tiles == 0:
        return out
    _prefill_kernel[(num_tiles, num_heads)](
        query, key_cache, value_cache, out, batch.tile_spans, batch.tile_rows, batch.query_starts,
        batch.query_lens, batch.context_lens, batch.block_table, scale * _LOG2E,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        batch.block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2_at_least(head_dim),
        BLOCK_M=batch.tile.block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, WINDOW=sliding_window or 0,
        IN_F32=_dots_in_float32(query.dtype), num_warps=batch.tile.num_warps,
    )
    return out
