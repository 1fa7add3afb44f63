"""Decode-only forward passes replayed as CUDA graphs: one graph per padded batch size (captured at
start-up, largest first, on padding rows), reading static input buffers (token ids, positions, slot
mapping, block table, context lengths) that each step fills.

A batch pads up to the smallest captured size with rows that write their K/V to slot 0 of block 0 (the
reserved block nobody's table uses) and attend to that one key; batches beyond the largest size run
eagerly. Where nothing is captured (capture=False: the CPU, the tests) the same padded static-buffer
forward runs eagerly, so the padding logic is checked without a GPU.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from shared.engine.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# Padded decode batch sizes: fine steps where a step's fixed cost matters most, coarser above.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
PAD_SLOT = 0  # slot 0 of block 0: the reserved block, never in a request's table


def padded_batch_size(num_decodes: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest batch size (sorted ascending) holding num_decodes rows; None beyond the largest."""
    index = bisect.bisect_left(batch_sizes, num_decodes)
    return batch_sizes[index] if index < len(batch_sizes) else None


class DecodeInputs:
    """The static buffers a captured graph reads, sized for the largest batch and widest block table."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device):
        def ids(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = ids(max_batch_size)
        self.positions = ids(max_batch_size)
        self.slot_mapping = ids(max_batch_size)
        self.block_table = ids(max_batch_size, max_blocks_per_seq)
        self.context_lens = torch.ones(max_batch_size, dtype=torch.long, device=device)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             batch_size: int) -> None:
        """Copy a step's n decode rows in and make rows n..batch_size padding. Columns of the block
        table past this step's width keep stale ids: no row reads past its context length."""
        n = input_ids.shape[0]
        width = meta.decode_block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"block table width {width} exceeds the static buffer's {self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_table[:n, :width].copy_(meta.decode_block_table)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        if batch_size > n:
            self.pad(n, batch_size)

    def pad(self, start: int, end: int) -> None:
        """Rows start..end become padding: token 0 at position 0, written to PAD_SLOT, seeing only itself."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(PAD_SLOT)
        self.block_table[start:end].zero_()
        self.context_lens[start:end].fill_(1)

    def metadata(self, batch_size: int, use_triton: bool) -> AttentionMetadata:
        """Views of the first batch_size rows: what a graph of that size is captured reading."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size], num_decode_tokens=batch_size,
            decode_block_table=self.block_table[:batch_size], decode_context_lens=self.context_lens[:batch_size],
            decode_key_mask=None, spans=[], use_triton=use_triton,
        )


class DecodeGraphs:
    """Runs decode-only batches of up to max(batch_sizes) rows on the static buffers: replaying the graph
    of their padded size (capture=True, CUDA; capture_all() at start-up, else on first use) or eagerly
    (capture=False)."""

    def __init__(self, model: torch.nn.Module, layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 max_blocks_per_seq: int, device: torch.device, *, use_triton: bool, capture: bool,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES):
        """The decode attention must need no key mask (the Triton path or the CPU kernel)."""
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.model = model
        self.layer_kv = layer_kv
        self.use_triton = use_triton
        self.capture = capture
        self.inputs = DecodeInputs(self.batch_sizes[-1], max_blocks_per_seq, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # one memory pool shared by every captured graph

    def capture_all(self) -> None:
        """Capture every batch size now, largest first (the smaller graphs reuse its memory pool), on
        padding rows: what a pod does while starting, so no serving step pays for a capture."""
        self.inputs.pad(0, self.batch_sizes[-1])
        with torch.inference_mode():  # as execute_model runs the replays
            for batch_size in reversed(self.batch_sizes):
                if batch_size not in self._graphs:
                    self._graphs[batch_size] = self._capture(batch_size)

    def can_run(self, num_decodes: int) -> bool:
        return padded_batch_size(num_decodes, self.batch_sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n rows (meta: its eager metadata)."""
        n = input_ids.shape[0]
        batch_size = padded_batch_size(n, self.batch_sizes)
        if batch_size is None:
            raise ValueError(f"{n} decodes exceed the largest graph batch size {self.batch_sizes[-1]}")
        self.inputs.fill(input_ids, positions, meta, batch_size)
        if not self.capture:
            return self._forward(batch_size)[:n]
        if batch_size not in self._graphs:
            self._graphs[batch_size] = self._capture(batch_size)
        graph, hidden = self._graphs[batch_size]
        graph.replay()
        return hidden[:n]

    def _forward(self, batch_size: int) -> torch.Tensor:
        meta = self.inputs.metadata(batch_size, self.use_triton)
        return self.model(self.inputs.input_ids[:batch_size], self.inputs.positions[:batch_size], self.layer_kv, meta)

    def _capture(self, batch_size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels): a graph may not
        # record any of that. The buffers hold padding or this step's real rows, so the warm-up writes
        # the same K/V the replay writes again.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch_size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a KV transfer thread may touch CUDA while the engine thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._forward(batch_size)
        if self._pool is None:
            self._pool = graph.pool()
        logger.info("captured a CUDA graph for decode batches of %d", batch_size)
        return graph, hidden
