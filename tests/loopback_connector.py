"""An in-process KV connector for tests: a producer engine and a consumer engine in one process share
a LoopbackKVStore, so the scheduler tests run the whole P/D handoff without a network.

Producer: a request with HoldForPeer has its prompt's blocks held under a lease by request_finished(),
which hands off a LoopbackHandle. Consumer: a request whose kv_transfer_params is that handle is
loaded asynchronously; start_load_kv() copies the blocks (when both sides registered KV tensors) and
releases the hold, which the producer then reports as finished_sending.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.engine.kv_transfer.connector import KVConnectorBase, KVConnectorMetadata, KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handoff import HoldForPeer, KvTransferParams
from shared.engine.request import RequestStatus


@dataclass(frozen=True)
class LoopbackHandle(KvTransferParams):
    """What a loopback producer hands off; a consumer request carries it to load those blocks."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    lease_deadline: float


@dataclass
class _Hold:
    block_ids: list[int]
    num_tokens: int
    deadline: float
    producer: "LoopbackConnector"


@dataclass
class LoadSpec:
    """One request's load this step: remote blocks -> local blocks."""

    request_id: str
    remote_engine_id: str | None
    remote_request_id: str | None
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class LoopbackConnectorMetadata(KVConnectorMetadata):
    # Holds the consumer found already covered by its own prefix cache: release without a copy.
    releases: list[tuple[str, str]] = field(default_factory=list)


class LoopbackKVStore:
    """The shared state between the engines of one process: holds by (engine id, request id)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._holds: dict[tuple[str, str], _Hold] = {}
        self._released: dict[str, set[str]] = {}

    def hold(self, engine_id: str, request_id: str, hold: _Hold) -> None:
        self._holds[(engine_id, request_id)] = hold

    def take(self, engine_id: str, request_id: str) -> _Hold | None:
        """The hold if it is still intact (present and within its lease); None otherwise."""
        hold = self._holds.get((engine_id, request_id))
        if hold is None or hold.deadline < self.clock():
            return None
        return hold

    def release(self, engine_id: str, request_id: str) -> bool:
        """Give the blocks back to the producer; True if the hold was still intact."""
        hold = self._holds.pop((engine_id, request_id), None)
        if hold is None:
            return False
        self._released.setdefault(engine_id, set()).add(request_id)
        return hold.deadline >= self.clock()

    def pop_released(self, engine_id: str) -> set[str]:
        """Released holds of a producer, plus its holds whose lease expired."""
        released = self._released.pop(engine_id, set())
        now = self.clock()
        for key in [k for k, h in self._holds.items() if k[0] == engine_id and h.deadline < now]:
            del self._holds[key]
            released.add(key[1])
        return released

    def num_holds(self, engine_id: str | None = None) -> int:
        return sum(1 for k in self._holds if engine_id is None or k[0] == engine_id)


class LoopbackConnector(KVConnectorBase):
    """Both sides of the in-process connector for one engine."""

    def __init__(
        self,
        role: KVRole,
        store: LoopbackKVStore,
        engine_id: str,
        block_size: int,
        lease_s: float = 30.0,
        load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE,
        block_dim: int = 0,
    ) -> None:
        super().__init__(role, load_failure_policy)
        self.store = store
        self.engine_id = engine_id
        self.block_size = block_size
        self.lease_s = lease_s
        self.block_dim = block_dim  # the dimension of a KV tensor that indexes blocks
        self.kv_caches: dict[str, Any] = {}
        self._loads: list[LoadSpec] = []
        self._releases: list[tuple[str, str]] = []
        self._finished_recving: set[str] = set()
        self._bad_block_ids: set[int] = set()
        # Consumer requests whose one load is decided: a resumed (preempted) request recomputes.
        self._resolved: set[str] = set()

    # ---- scheduler side -----------------------------------------------------------------------
    def _remote(self, request) -> LoopbackHandle | None:
        handle = request.kv_transfer_params
        if self.role == KVRole.PRODUCER or not isinstance(handle, LoopbackHandle):
            return None
        return None if request.request_id in self._resolved else handle

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        handle = self._remote(request)
        if handle is None:
            return 0, False
        num_remote = min(handle.num_tokens, request.num_tokens - 1)
        num_external = max(0, num_remote - num_computed_tokens)
        return num_external, num_external > 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        handle = self._remote(request)
        if handle is None:
            if num_external_tokens > 0:
                # External tokens without a handle (a subclass or test decided them): a load
                # entry without a source, which start_load_kv reports as failed.
                first = (request.num_computed_tokens) // self.block_size
                self._loads.append(LoadSpec(request.request_id, None, None, [], list(block_ids[first:])))
            return
        self._resolved.add(request.request_id)  # one pull per handle; a later resume recomputes
        key = (handle.engine_id, handle.request_id)
        if num_external_tokens <= 0:
            self._releases.append(key)
            return
        num_remote = min(handle.num_tokens, request.num_tokens - 1)
        first = (num_remote - num_external_tokens) // self.block_size
        last = -(-num_remote // self.block_size)
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                remote_engine_id=key[0],
                remote_request_id=key[1],
                remote_block_ids=list(handle.block_ids[first:last]),
                local_block_ids=list(block_ids[first:last]),
            )
        )

    def build_connector_meta(self, scheduler_output) -> LoopbackConnectorMetadata:
        meta = LoopbackConnectorMetadata(requests=self._loads, releases=self._releases)
        self._loads, self._releases = [], []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, LoopbackHandle | None]:
        remote = self._remote(request)
        self._resolved.discard(request.request_id)
        if remote is not None:
            # Ended before its pull was scheduled (abort): the producer must not hold for nobody.
            self.store.release(remote.engine_id, remote.request_id)
        if self.role == KVRole.CONSUMER or not isinstance(request.kv_transfer_params, HoldForPeer):
            return False, None
        # Only a request capped at its hand-off token continues on the peer; a stop (EOS, stop
        # token) or an abort ends it here and frees the blocks at once.
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        num_blocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or num_blocks > len(block_ids):
            return False, None
        held = list(block_ids[:num_blocks])
        deadline = self.store.clock() + self.lease_s
        self.store.hold(self.engine_id, request.request_id, _Hold(held, num_tokens, deadline, self))
        handle = LoopbackHandle(self.engine_id, request.request_id, tuple(held), num_tokens, self.block_size, deadline)
        return True, handle

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for engine_id, request_id in metadata.releases:
            self.store.release(engine_id, request_id)
        for load in metadata.requests:
            if load.remote_engine_id is None:
                self._bad_block_ids.update(load.local_block_ids)
                self._finished_recving.add(load.request_id)
                continue
            hold = self.store.take(load.remote_engine_id, load.remote_request_id)
            ok = hold is not None and self._copy(hold.producer, load)
            # Release even on failure: the producer must not keep blocks nobody will read.
            intact = self.store.release(load.remote_engine_id, load.remote_request_id)
            if not (ok and intact):
                self._bad_block_ids.update(load.local_block_ids)
            self._finished_recving.add(load.request_id)

    def _copy(self, producer: "LoopbackConnector", load: LoadSpec) -> bool:
        if not self.kv_caches and not producer.kv_caches:
            return True  # scheduler-level use: no tensors to move
        if self.kv_caches.keys() != producer.kv_caches.keys():
            return False  # layout mismatch: never use KV that is not known good
        import torch

        src_index = torch.tensor(load.remote_block_ids, dtype=torch.long)
        dst_index = torch.tensor(load.local_block_ids, dtype=torch.long)
        for name, dst in self.kv_caches.items():
            src = producer.kv_caches[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                return False
            dst.index_copy_(self.block_dim, dst_index, src.index_select(self.block_dim, src_index).to(dst.device))
        return True

    def wait_for_save(self) -> None:
        return None  # pull-based: the producer never pushes

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self.store.pop_released(self.engine_id) if self.role != KVRole.CONSUMER else set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_block_ids = self._bad_block_ids, set()
        return bad
