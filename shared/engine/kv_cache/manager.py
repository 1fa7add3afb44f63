"""The KV-cache manager: per-request block tables over a shared block pool, with prefix caching
through chained block hashes (one KV-cache group, full attention).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from shared.engine.kv_cache.hashing import BlockHash, hash_block, root_hash
from shared.engine.request import Request


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the pool for metrics (the null block is not counted)."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # blocks holding a published prefix (used or free)
    num_held_blocks: int = 0  # used blocks kept for a peer's pull (finished producer requests)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last take (tokens)."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    """Block tables for requests: look up cached prefixes, allocate, cache, free."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_seed: str = "",
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._root_hash = root_hash(hash_seed)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many leading blocks are published in the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- hashing --------------------------------------------------------------------------
    @property
    def root_hash(self) -> BlockHash:
        """The parent hash of a request's first block (routers hash prompts from it too)."""
        return self._root_hash

    def update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend request.block_hashes to cover every full block of its known tokens."""
        hashes = request.block_hashes
        block_size = self.block_size
        num_full = len(request.all_token_ids) // block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else self._root_hash
            keyed = bool(request.mm_positions) or request.cache_salt is not None
            for index in range(len(hashes), num_full):
                start = index * block_size
                extra = self._extra_keys(request, index, start) if keyed else None
                parent = hash_block(parent, tokens[start:start + block_size], extra)
                hashes.append(parent)
        return hashes

    def _extra_keys(self, request: Request, index: int, start: int) -> list[object] | None:
        keys: list[object] = []
        if index == 0 and request.cache_salt is not None:
            keys.append(f"salt:{request.cache_salt}")
        end = start + self.block_size
        for mm_hash, pos in zip(request.mm_hashes, request.mm_positions):
            if pos.offset < end and pos.offset + pos.length > start:
                keys.append(f"mm:{mm_hash}:{pos.offset - start}")
        return keys or None

    # ---- lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request (in whole blocks) and its token count.

        At least the last token is always left to compute, so the step samples."""
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get_cached_block = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.num_queried_tokens += request.num_tokens
        stats.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for num_new_tokens after the computed ones (local prefix hits
        `new_computed_blocks` covering `num_new_computed_tokens`, then external tokens), plus
        lookahead slots. Returns the ids of newly allocated blocks, or None when the pool cannot
        provide them (nothing changes then). delay_cache_blocks leaves the new blocks out of
        the prefix cache until their content lands (asynchronous KV loads)."""
        req_id = request.request_id
        req_blocks = self._blocks.get(req_id)
        if req_blocks is None:
            req_blocks = self._blocks[req_id] = []
            self._num_cached[req_id] = 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        if num_slots > self.max_model_len:
            num_slots = self.max_model_len
        num_hit_blocks = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = -(-num_slots // self.block_size) - len(req_blocks) - num_hit_blocks
        new_block_ids: list[int] = []
        if num_new_blocks > 0 or num_hit_blocks:
            pool = self.block_pool
            # Hits sitting in the free queue take free capacity too.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hit_blocks else 0
            if max(num_new_blocks, 0) + num_revived > pool.get_num_free_blocks():
                return None
            if num_hit_blocks:
                pool.touch(new_computed_blocks)
                req_blocks.extend(new_computed_blocks)
                self._num_cached[req_id] = max(self._num_cached[req_id], num_hit_blocks)
            if num_new_blocks > 0:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
                new_block_ids = [b.block_id for b in new_blocks]
        if self.enable_caching and not delay_cache_blocks:
            num_known = num_computed + num_new_tokens
            if num_known > request.num_tokens:
                num_known = request.num_tokens
            # cache_blocks() leaves out a request that skips the prefix cache.
            if num_known // self.block_size > self._num_cached[req_id]:
                self.cache_blocks(request, num_known)
        return new_block_ids

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks covering its first num_tokens (known) tokens."""
        if not self.enable_caching or request.skips_prefix_cache:
            return
        req_id = request.request_id
        req_blocks = self._blocks.get(req_id)
        if not req_blocks:
            return
        num_full = min(num_tokens // self.block_size, len(req_blocks))
        start = self._num_cached[req_id]
        if num_full <= start:
            return
        hashes = self.update_block_hashes(request)
        cache_block = self.block_pool.cache_block
        for index in range(start, num_full):
            cache_block(req_blocks[index], hashes[index])
        self._num_cached[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail blocks become the first to be evicted."""
        req_id = request.request_id
        blocks = self._blocks.pop(req_id, None)
        self._num_cached.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def invalidate_blocks(self, request: Request, bad_block_ids: set[int]) -> int | None:
        """Withdraw the request's blocks from the first bad one on from the prefix cache; return
        that block's index in the request's table (None if no block of it is bad)."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return None
        for index, block in enumerate(blocks):
            if block.block_id in bad_block_ids:
                self.block_pool.uncache_blocks(blocks[index:])
                self._num_cached[request.request_id] = min(self._num_cached[request.request_id], index)
                return index
        return None

    # ---- queries --------------------------------------------------------------------------
    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(req_id, ())]

    def get_num_blocks(self, req_id: str) -> int:
        return len(self._blocks.get(req_id, ()))

    def get_num_cached_blocks(self, req_id: str) -> int:
        return self._num_cached.get(req_id, 0)

    def get_num_common_prefix_blocks(self, requests: list[Request]) -> int:
        """Leading blocks of requests[0]'s table that every one of requests shares."""
        if not requests:
            return 0
        blocks = self._blocks.get(requests[0].request_id, ())
        num_requests = len(requests)
        if len(self._blocks) == num_requests:
            # Every block table belongs to one of the requests, so a block's ref count is exactly
            # the number of them holding it.
            count = 0
            for block in blocks:
                if block.ref_cnt != num_requests:
                    break
                count += 1
            return count
        # Other holders (a request waiting for remote KV, blocks held for a peer) raise ref counts
        # too: compare the tables themselves.
        others = [self._blocks.get(request.request_id, ()) for request in requests[1:]]
        count = 0
        for index, block in enumerate(blocks):
            if block.ref_cnt < num_requests:
                break
            if not all(len(table) > index and table[index] is block for table in others):
                break
            count += 1
        return count

    def has_blocks(self, req_id: str) -> bool:
        return bool(self._blocks.get(req_id))

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_usage(self) -> KVCacheUsage:
        pool = self.block_pool
        free = pool.get_num_free_blocks()
        return KVCacheUsage(
            num_total_blocks=pool.num_usable_blocks,
            num_free_blocks=free,
            num_used_blocks=pool.num_usable_blocks - free,
            num_cached_blocks=pool.num_cached_blocks,
        )

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.enable_caching:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
