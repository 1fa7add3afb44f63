"""The router's prefix-cache index: which block hashes each pod holds, kept exact by the pods' KV event
streams, and how many leading blocks of a prompt each pod already has. Pure data, no I/O: every router
replica that applies the same events holds the same index."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from shared.engine.kv_cache.events import KvEventKind
from shared.engine.kv_cache.hashing import BlockHash, hash_block
from shared.serving.wire.payloads import KvEventUpdate

logger = logging.getLogger(__name__)

# Router-side cap on hashes kept per pod (about 120 bytes each in a Python set: ~15 MiB per pod at the
# cap). A pod's pool is smaller than this in any sane deployment; past it, stores are dropped and counted.
DEFAULT_MAX_BLOCKS_PER_POD = 131072


@dataclass
class _PodCache:
    engine_id: str
    block_size: int
    root_hash: BlockHash
    hashes: set[BlockHash] = field(default_factory=set)


class PromptHashes:
    """One prompt's chained block hashes, computed once per (block size, root hash) and shared by every
    pick of the request."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = token_ids
        self._by_layout: dict[tuple[int, BlockHash], list[BlockHash]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def for_layout(self, block_size: int, root_hash: BlockHash) -> list[BlockHash]:
        key = (block_size, root_hash)
        hashes = self._by_layout.get(key)
        if hashes is None:
            hashes = self._by_layout[key] = self._hash(block_size, root_hash)
        return hashes

    def _hash(self, block_size: int, parent: BlockHash) -> list[BlockHash]:
        # A pod never reuses the block holding the last prompt token (it must compute that one to
        # sample), so only blocks that end before it count.
        tokens = self.token_ids
        hashes = []
        for start in range(0, (len(tokens) - 1) // block_size * block_size, block_size):
            parent = hash_block(parent, tokens[start:start + block_size])
            hashes.append(parent)
        return hashes


class KvIndex:
    """Per pod (by address): its engine incarnation and the hashes in its prefix cache."""

    def __init__(self, max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD):
        if max_blocks_per_pod < 1:
            raise ValueError(f"max_blocks_per_pod must be >= 1, got {max_blocks_per_pod}")
        self.max_blocks_per_pod = max_blocks_per_pod
        self._pods: dict[str, _PodCache] = {}
        self.num_dropped_stores = 0

    # ---- building -----------------------------------------------------------------------------
    def apply(self, address: str, update: KvEventUpdate) -> None:
        """Applies one message of the pod's stream. A snapshot, or a new engine id (the pod restarted),
        replaces everything known about the pod."""
        pod = self._pods.get(address)
        if update.is_snapshot or pod is None or pod.engine_id != update.engine_id:
            if pod is not None and pod.engine_id != update.engine_id:
                logger.info("kv index: %s is now engine %s (was %s)", address, update.engine_id, pod.engine_id)
            pod = self._pods[address] = _PodCache(update.engine_id, update.block_size, update.root_hash)
        hashes = pod.hashes
        for event in update.events:
            if event.kind is KvEventKind.STORED:
                if len(hashes) < self.max_blocks_per_pod:
                    hashes.add(event.block_hash)
                else:
                    self.num_dropped_stores += 1
            elif event.kind is KvEventKind.REMOVED:
                hashes.discard(event.block_hash)
            else:
                hashes.clear()

    def forget(self, address: str) -> None:
        """The pod's stream ended: what it held is no longer known."""
        self._pods.pop(address, None)

    # ---- queries ------------------------------------------------------------------------------
    def engine_id(self, address: str) -> str | None:
        pod = self._pods.get(address)
        return None if pod is None else pod.engine_id

    def hashes(self, address: str) -> frozenset[BlockHash]:
        pod = self._pods.get(address)
        return frozenset() if pod is None else frozenset(pod.hashes)

    def block_size(self, address: str) -> int | None:
        pod = self._pods.get(address)
        return None if pod is None else pod.block_size

    def cached_tokens(self, address: str, prompt: PromptHashes) -> int:
        """How many leading prompt tokens the pod holds in its prefix cache (whole blocks)."""
        pod = self._pods.get(address)
        if pod is None or not pod.hashes:
            return 0
        held = pod.hashes
        num_blocks = 0
        for block_hash in prompt.for_layout(pod.block_size, pod.root_hash):
            if block_hash not in held:
                break
            num_blocks += 1
        return num_blocks * pod.block_size

    def cached_tokens_by_pod(self, addresses: Iterable[str], prompt: PromptHashes) -> dict[str, int]:
        return {address: self.cached_tokens(address, prompt) for address in addresses}

    @property
    def num_blocks(self) -> int:
        return sum(len(pod.hashes) for pod in self._pods.values())
