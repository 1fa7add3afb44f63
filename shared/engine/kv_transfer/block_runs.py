"""Coalescing of (remote block, local block) pairs into runs that are contiguous on both sides.

A run becomes one transfer descriptor per KV tensor, so fewer runs means fewer, larger descriptors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class BlockRun:
    """num_blocks consecutive blocks starting at remote_start, landing at consecutive local_start..."""

    remote_start: int
    local_start: int
    num_blocks: int


@dataclass(frozen=True)
class BlockRunArrays:
    """The same runs as parallel int64 arrays, which transfer descriptors are computed from."""

    remote_starts: np.ndarray
    local_starts: np.ndarray
    num_blocks: np.ndarray

    def __len__(self) -> int:
        return len(self.num_blocks)

    def to_list(self) -> list[BlockRun]:
        return [
            BlockRun(int(remote), int(local), int(count))
            for remote, local, count in zip(self.remote_starts, self.local_starts, self.num_blocks)
        ]


def coalesce_block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair remote_block_ids[i] with local_block_ids[i] and merge pairs that extend a run on both sides.

    Pairs are ordered by remote block id first: each pair is an independent copy, so the order is
    free, and sorting lets a caller's unordered ids still merge. A local block may appear only once
    (two sources for one destination would race); a remote block may be read into several places.
    """
    return coalesce_block_run_arrays(remote_block_ids, local_block_ids).to_list()


def coalesce_block_run_arrays(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> BlockRunArrays:
    """coalesce_block_runs, vectorised: thousands of blocks per request cost well under a millisecond."""
    remote = as_block_id_array("remote_block_ids", remote_block_ids)
    local = as_block_id_array("local_block_ids", local_block_ids)
    if len(remote) != len(local):
        raise ValueError(f"remote_block_ids has {len(remote)} ids but local_block_ids has {len(local)}")
    if len(remote) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRunArrays(empty, empty, empty)
    sorted_local = np.sort(local)
    if (sorted_local[1:] == sorted_local[:-1]).any():
        raise ValueError(f"local_block_ids contains duplicates: {local.tolist()}")
    # A request's blocks usually come in ascending remote order already: skip the sort then (at a
    # handful of blocks, numpy's fixed costs are most of a small READ's set-up time).
    if not (remote[1:] > remote[:-1]).all():
        order = np.lexsort((local, remote))  # by remote id, then local id
        remote, local = remote[order], local[order]
    breaks = np.flatnonzero((remote[1:] - remote[:-1] != 1) | (local[1:] - local[:-1] != 1)) + 1
    starts = np.concatenate(([0], breaks))
    num_blocks = np.diff(np.concatenate((starts, [len(remote)])))
    return BlockRunArrays(remote[starts], local[starts], num_blocks)


def as_block_id_array(name: str, block_ids: Sequence[int]) -> np.ndarray:
    """Block ids as a 1-D int64 array; ValueError for anything that is not a sequence of integers."""
    array = np.asarray(block_ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a flat sequence of integers, got {array.dtype} of shape {array.shape}")
    return array.astype(np.int64, copy=False)
