"""A KV pool's layout as NIXL sees it (memory type, one region per tensor, bytes per block) and what
follows from it: whether a peer's pool can exchange blocks with ours, and the descriptors a transfer posts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from shared.engine.kv_transfer.handle import KvRegion, KvSource

if TYPE_CHECKING:
    import torch

MEM_TYPES = ("DRAM", "VRAM")


class KvLayoutMismatchError(ValueError):
    """A peer's KV pool cannot exchange blocks with ours (memory type, tensor count or block size differ)."""


@dataclass(frozen=True)
class PoolLayout:
    """Layout of a KV pool, local or a peer's."""

    mem_type: str
    regions: tuple[KvRegion, ...]
    block_bytes: int
    num_blocks: int


def describe_pool(kv_tensors: Sequence["torch.Tensor"]) -> PoolLayout:
    if not kv_tensors:
        raise ValueError("kv_tensors is empty")
    first = kv_tensors[0]
    for index, tensor in enumerate(kv_tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"kv_tensors[{index}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                f"kv_tensors[0] is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"kv_tensors[{index}] is not contiguous")
    if first.dim() < 1 or first.shape[0] == 0 or first.numel() == 0:
        raise ValueError(f"kv tensors must be [num_blocks, ...] with num_blocks > 0, got {tuple(first.shape)}")
    mem_type, device_id = nixl_memory_type(first.device)
    num_bytes = first.numel() * first.element_size()
    regions = tuple(KvRegion(tensor.data_ptr(), num_bytes, device_id) for tensor in kv_tensors)
    return PoolLayout(mem_type, regions, num_bytes // first.shape[0], first.shape[0])


def nixl_memory_type(device: "torch.device") -> tuple[str, int]:
    """How NIXL names memory on this device: ("DRAM", 0) for the CPU, ("VRAM", index) for a GPU.

    VRAM with the device index lets UCX pick cuda_ipc between processes on one machine (the peer
    opens an IPC handle of our allocation) instead of staging through host memory.
    """
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        # "cuda" without an index means the current device; torch tensors always carry one.
        return "VRAM", device.index or 0
    raise ValueError(f"kv tensors on {device} cannot be registered with NIXL (cpu or cuda only)")


def check_compatible(pool: PoolLayout, source: KvSource) -> None:
    if source.mem_type not in MEM_TYPES:
        raise ValueError(f"peer {source.agent_name!r} has unknown memory type {source.mem_type!r}")
    if source.mem_type != pool.mem_type:
        # Both sides of the handoff keep KV on the same kind of device (a split deployment runs
        # prefill and decode pods with the same --device); a mixed pair is a misconfiguration, and
        # its transfers would stage through host memory even if UCX accepted them.
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} keeps its KV pool in {source.mem_type}, this pool is in "
            f"{pool.mem_type}: run prefill and decode pods with the same --device"
        )
    if len(source.regions) != len(pool.regions):
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} has {len(source.regions)} KV tensors, this pool has {len(pool.regions)}"
        )
    if source.block_bytes != pool.block_bytes:
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} has {source.block_bytes} bytes per block, this pool has {pool.block_bytes}"
        )
    for region in source.regions:
        if region.num_bytes < source.num_blocks * source.block_bytes:
            raise ValueError(
                f"peer {source.agent_name!r} region {region} is smaller than its {source.num_blocks} blocks"
            )


def check_block_ids(side: str, block_ids: np.ndarray, num_blocks: int) -> None:
    bad = block_ids[(block_ids < 0) | (block_ids >= num_blocks)]
    if len(bad):
        raise ValueError(f"{side} block ids {bad[:8].tolist()} are outside 0..{num_blocks - 1}")


def region_arrays(regions: Sequence[KvRegion]) -> tuple[np.ndarray, np.ndarray]:
    """(base addresses, device ids) of a pool's tensors as uint64 arrays, made once per pool."""
    bases = np.array([region.base_address for region in regions], dtype=np.uint64)
    device_ids = np.array([region.device_id for region in regions], dtype=np.uint64)
    return bases, device_ids


def run_descs(region_arrays: tuple[np.ndarray, np.ndarray], block_bytes: int, starts: np.ndarray,
               num_blocks: np.ndarray) -> np.ndarray:
    """(address, length, device id) rows: for each tensor in order, one row per run."""
    bases, device_ids = region_arrays
    offsets = starts.astype(np.uint64) * np.uint64(block_bytes)
    lengths = num_blocks.astype(np.uint64) * np.uint64(block_bytes)
    descs = np.empty((len(bases) * len(starts), 3), dtype=np.uint64)
    descs[:, 0] = (bases[:, None] + offsets[None, :]).ravel()
    descs[:, 1] = np.tile(lengths, len(bases))
    descs[:, 2] = np.repeat(device_ids, len(starts))
    return descs
