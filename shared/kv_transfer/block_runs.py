"""Coalescing of (remote block, local block) pairs into runs that are contiguous on both sides.

A run becomes one transfer descriptor per KV tensor, so fewer runs means fewer, larger descriptors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BlockRun:
    """num_blocks consecutive blocks starting at remote_start, landing at consecutive local_start..."""

    remote_start: int
    local_start: int
    num_blocks: int


def coalesce_block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair remote_block_ids[i] with local_block_ids[i] and merge pairs that extend a run on both sides.

    Pairs are ordered by remote block id first: each pair is an independent copy, so the order is
    free, and sorting lets a caller's unordered ids still merge. A local block may appear only once
    (two sources for one destination would race); a remote block may be read into several places.
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"remote_block_ids has {len(remote_block_ids)} ids but local_block_ids has {len(local_block_ids)}"
        )
    if len(set(local_block_ids)) != len(local_block_ids):
        raise ValueError(f"local_block_ids contains duplicates: {list(local_block_ids)}")
    pairs = sorted(zip(remote_block_ids, local_block_ids))
    runs: list[BlockRun] = []
    for remote_id, local_id in pairs:
        if runs:
            last = runs[-1]
            if (
                remote_id == last.remote_start + last.num_blocks
                and local_id == last.local_start + last.num_blocks
            ):
                runs[-1] = BlockRun(last.remote_start, last.local_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(remote_id, local_id, 1))
    return runs
