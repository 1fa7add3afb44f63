"""The prefix-cache event log: which block hashes a pool stores and removes, recorded on the engine
thread and taken in batches by whoever publishes them (bounded: past the cap it only says it overflowed).
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from shared.engine.kv_cache.hashing import BlockHash

# Pod-side cap on events waiting to be published (32-byte hashes: about 4 MiB at the cap). Past it the
# log drops events and reports the overflow, and the publisher sends a fresh snapshot instead.
DEFAULT_MAX_PENDING_EVENTS = 65536


class KvEventKind(enum.Enum):
    STORED = "stored"  # a full block was published in the prefix cache under this hash
    REMOVED = "removed"  # the hash left the prefix cache (evicted, or its content withdrawn)
    CLEARED = "cleared"  # every hash left the prefix cache at once (the hash field is empty)


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    block_hash: BlockHash = b""


@dataclass(frozen=True)
class KvEventBatch:
    """What one take() returns: the events in order, or overflowed (then they are incomplete)."""

    events: list[KvEvent]
    overflowed: bool


class KvEventLog:
    """Filled by the block pool on the engine thread, taken from another thread (hence the lock)."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING_EVENTS) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._events: list[KvEvent] = []
        self._overflowed = False

    def record(self, kind: KvEventKind, block_hash: BlockHash = b"") -> None:
        with self._lock:
            if len(self._events) >= self.max_pending:
                self._overflowed = True
                return
            self._events.append(KvEvent(kind, block_hash))

    def take(self) -> KvEventBatch:
        with self._lock:
            batch = KvEventBatch(self._events, self._overflowed)
            self._events, self._overflowed = [], False
        return batch
