"""Where a KV pool lives, as NIXL and the peer see it: the memory-type decision, the source
description's round trip with VRAM regions, the refusal of a DRAM/VRAM pair and the NIXL wheel choice.

Pure checks (no NIXL agent, no GPU): a CUDA torch.device is only a name here.
"""
from __future__ import annotations

import pytest
import torch

from shared.engine.kv_transfer.handle import KvLayout, KvRegion, KvSource
from shared.engine.kv_transfer.nixl_loading import nixl_module_names
from shared.engine.kv_transfer.pool_layout import (
    KvLayoutMismatchError,
    PoolLayout,
    check_compatible,
    describe_pool,
    nixl_memory_type,
)
from shared.serving.wire.prefill import kv_source_from_proto, kv_source_to_proto
from shared.serving.wire import payloads as wire

LAYOUT = KvLayout("llama3-8b", "bfloat16", 2, 8, 128, 16)


def test_cpu_is_dram_and_cuda_is_vram_with_its_device_index():
    assert nixl_memory_type(torch.device("cpu")) == ("DRAM", 0)
    assert nixl_memory_type(torch.device("cuda", 0)) == ("VRAM", 0)
    assert nixl_memory_type(torch.device("cuda", 3)) == ("VRAM", 3)
    with pytest.raises(ValueError, match="cpu or cuda only"):
        nixl_memory_type(torch.device("meta"))


def test_cpu_pool_is_described_as_dram_regions():
    tensors = [torch.zeros((4, 16, 8, 128), dtype=torch.bfloat16) for _ in range(4)]
    pool = describe_pool(tensors)
    assert pool.mem_type == "DRAM"
    assert [region.device_id for region in pool.regions] == [0, 0, 0, 0]
    assert pool.block_bytes == 16 * 8 * 128 * 2 and pool.num_blocks == 4
    with pytest.raises(ValueError, match="cpu or cuda only"):
        describe_pool([torch.zeros((4, 16), device="meta")])


def test_vram_source_round_trips_with_memory_type_and_device_ids():
    regions = tuple(KvRegion(0x7F0000000000 + i * 0x100000, 1 << 20, 1) for i in range(4))
    source = wire.PrefillKvSource("eng", LAYOUT, KvSource("prefill-x", b"meta", "VRAM", regions, 65536, 16))
    decoded = kv_source_from_proto(kv_source_to_proto(source))
    assert decoded == source
    assert decoded.source.mem_type == "VRAM"
    assert {region.device_id for region in decoded.source.regions} == {1}


def _pool(mem_type: str) -> PoolLayout:
    return PoolLayout(mem_type, tuple(KvRegion(0x1000 * (i + 1), 4096, 0) for i in range(4)), 256, 16)


def _source(mem_type: str) -> KvSource:
    return KvSource("peer", b"", mem_type, tuple(KvRegion(0x9000 * (i + 1), 4096, 0) for i in range(4)), 256, 16)


@pytest.mark.parametrize("local, remote", [("DRAM", "VRAM"), ("VRAM", "DRAM")])
def test_a_dram_vram_pair_is_a_layout_mismatch_naming_both(local, remote):
    with pytest.raises(KvLayoutMismatchError, match=f"in {remote}, this pool is in {local}.*same --device"):
        check_compatible(_pool(local), _source(remote))


def test_same_memory_type_pairs_are_compatible():
    for mem_type in ("DRAM", "VRAM"):
        check_compatible(_pool(mem_type), _source(mem_type))  # no exception


def test_nixl_wheel_for_torchs_cuda_major_comes_first():
    assert nixl_module_names("13.0") == ("nixl_cu13", "nixl_cu12")
    assert nixl_module_names("12.8") == ("nixl_cu12", "nixl_cu13")
    assert nixl_module_names(None) == ("nixl_cu12", "nixl_cu13")  # a CPU build of torch
