"""The pool of KV-cache blocks: a reserved null block, ref counts, an LRU free queue and the
prefix-cache map from block hash to block. Cached blocks stay cached while free and are evicted
lazily, only when the free queue hands them out again.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from shared.engine.kv_cache.events import KvEventKind, KvEventLog
from shared.engine.kv_cache.hashing import BlockHash


class KVCacheBlock:
    """One block of the paged KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Allocation, sharing and lazy eviction of blocks. Block 0 is the null block, never handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently in use: padding for skipped positions
        # Front = least recently freed = next to hand out. An OrderedDict gives O(1) removal of a
        # free cached block when a prefix hit revives it.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # Set while someone follows the prefix cache (a router subscribed): None costs one check.
        self.event_log: KvEventLog | None = None

    # ---- queries --------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def get_usage(self) -> float:
        return self.get_num_used_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache (a snapshot; call on the thread that owns the pool)."""
        return list(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be handed out first)."""
        return list(self._free)

    # ---- allocation -----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the front of the free queue, evicting their cached hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot get {num_blocks} blocks, only {len(self._free)} free")
        popitem = self._free.popitem
        blocks = []
        for _ in range(num_blocks):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share cached blocks with one more request (reviving them if they were free)."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the back of the free queue
        in the given order (so pass them in the order they should be evicted)."""
        free = self._free
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")

    # ---- prefix cache ---------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash. If another block already holds that content,
        this one stays private (first writer wins; both hold identical KV)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.event_log is not None:
            self.event_log.record(KvEventKind.STORED, block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        del self._cached[block.block_hash]
        if self.event_log is not None:
            self.event_log.record(KvEventKind.REMOVED, block.block_hash)
        block.block_hash = None
        self.num_evictions += 1

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw blocks from the prefix cache (their content is known bad)."""
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_used_blocks() > 0:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.event_log is not None:
            self.event_log.record(KvEventKind.CLEARED)
        return True
