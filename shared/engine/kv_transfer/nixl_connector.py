"""The NIXL KV connector: a prefill engine holds a finished prompt's blocks under a lease (producer),
a decode engine pulls them with NIXL READs and uses them only once the hold is confirmed (consumer).

Every method runs on the engine thread except release() and on_release_result(), which the gRPC
side calls; the state they share sits behind one lock.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shared.engine.kv_transfer.connector import KVConnectorBase, KVConnectorMetadata, KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullOutcome, KvPullStats
from shared.engine.kv_transfer.handle import KvSource
from shared.engine.kv_transfer.transfer_agent import KvTransfer, KvTransferAgent, KvTransferError, TransferState
from shared.engine.request import RequestStatus

logger = logging.getLogger(__name__)

# Keys of Request.kv_transfer_params.
DO_REMOTE_DECODE = "do_remote_decode"  # producer: hold the prompt's blocks for a decode pod
REMOTE_HANDLE = "handle"  # consumer: pull these blocks (KvHandle)
REMOTE_SOURCE = "source"  # consumer: the prefill agent to pull from (KvSource)

# A pull still pending after this long is cancelled and the prompt recomputed.
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


@dataclass
class _Hold:
    request_id: str
    block_ids: list[int]
    deadline_unix_ms: int


@dataclass
class _Pull:
    """One consumer request's pull, from allocation to the confirmed (or refused) release."""

    request_id: str
    handle: KvHandle
    source: KvSource
    local_block_ids: list[int]
    remote_block_ids: list[int]
    num_cached_blocks: int
    transfer: KvTransfer | None = None
    is_aborted: bool = False  # the request ended while its READ was in flight
    is_confirming: bool = False  # READ over (or abandoned), ReleaseKv asked
    error: str | None = None


@dataclass
class PullMetadata(KVConnectorMetadata):
    """This step's pulls to post (consumer)."""

    requests: list[_Pull] = field(default_factory=list)


class NixlConnector(KVConnectorBase):
    """Producer or consumer side of the lease-confirmed pull protocol (DESIGN.md section 3)."""

    def __init__(
        self,
        role: KVRole,
        *,
        engine_id: str,
        layout: KvLayout,
        agent: KvTransferAgent,
        source_address: str = "",
        lease_s: float = 30.0,
        failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ):
        if role is KVRole.BOTH:
            raise ValueError("the NIXL connector runs as kv_producer or kv_consumer, not kv_both")
        super().__init__(role)
        self.engine_id = engine_id
        self.layout = layout
        self.agent = agent
        self.source_address = source_address
        self.lease_s = lease_s
        self.failure_policy = failure_policy
        self.transfer_timeout_s = transfer_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        # Producer state.
        self._holds: dict[str, _Hold] = {}
        self._released: set[str] = set()  # holds ended, blocks not yet freed by the scheduler
        self.num_lease_expiries = 0
        # Consumer state.
        self._to_post: list[_Pull] = []
        self._pulls: dict[str, _Pull] = {}  # posted, not yet confirmed
        self._confirmations: dict[str, bool] = {}  # request id -> intact, from ReleaseKv
        self._landed: set[str] = set()
        self._ended: set[str] = set()  # aborted mid-pull, now safe to free
        self._bad_block_ids: set[int] = set()
        self._stats: dict[str, KvPullStats] = {}
        # Requests whose one pull attempt is decided: a resumed (preempted) request recomputes.
        self._resolved: set[str] = set()
        # Set by the composition root: posts ReleaseKv(handle, request_id) off the engine thread and
        # reports back through on_release_result; and wakes the engine loop.
        self.release_remote: Callable[[KvHandle, str], None] | None = None
        self.wake: Callable[[], None] = lambda: None

    # ==== producer ============================================================================
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.role is KVRole.CONSUMER:
            return self._consumer_request_finished(request)
        params = request.kv_transfer_params or {}
        # Only a prompt cut at token 1 (max_tokens capped for the handoff) continues on a decode pod;
        # EOS, a stop token or an abort end it here and its blocks are freed at once.
        if not params.get(DO_REMOTE_DECODE) or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        num_tokens = request.num_prompt_tokens
        held = list(block_ids[: math.ceil(num_tokens / self.layout.block_size)])
        deadline = int((self._clock() + self.lease_s) * 1000)
        with self._lock:
            self._holds[request.request_id] = _Hold(request.request_id, held, deadline)
        handle = KvHandle(
            engine_id=self.engine_id,
            source_address=self.source_address,
            block_ids=tuple(held),
            num_tokens=num_tokens,
            block_size=self.layout.block_size,
            layout=self.layout,
            lease_deadline_unix_ms=deadline,
        )
        return True, {REMOTE_HANDLE: handle}

    def release(self, request_id: str, engine_id: str) -> bool:
        """End a hold (any thread). True only if the hold was in place until now: the pulled data is good."""
        now_ms = int(self._clock() * 1000)
        with self._lock:
            hold = self._holds.pop(request_id, None) if engine_id == self.engine_id else None
            if hold is None:
                return False
            self._released.add(request_id)
        self.wake()
        return now_ms < hold.deadline_unix_ms

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(hold.block_ids) for hold in self._holds.values())

    def _producer_finished(self) -> set[str]:
        # Reading notifications is what keeps UCX progressing for the peers' READs.
        self.agent.progress()
        now_ms = int(self._clock() * 1000)
        with self._lock:
            expired = [rid for rid, hold in self._holds.items() if now_ms >= hold.deadline_unix_ms]
            for request_id in expired:
                del self._holds[request_id]
            self.num_lease_expiries += len(expired)
            finished, self._released = self._released | set(expired), set()
        if expired:
            logger.info("lease expired for %d held request(s): %s", len(expired), expired)
        return finished

    # ==== consumer: scheduler side ============================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.role is not KVRole.CONSUMER:
            return 0, False
        params = request.kv_transfer_params or {}
        handle: KvHandle | None = params.get(REMOTE_HANDLE)
        if handle is None or request.request_id in self._resolved:
            return 0, False
        outcome = self.pull_precheck(handle)
        if outcome is None and handle.num_tokens <= num_computed_tokens:
            outcome = KvPullOutcome.PREFIX_CACHE_HIT
        if outcome is not None:
            # Nothing to read: record why and end the remote hold right away.
            cached_blocks = num_computed_tokens // self.layout.block_size
            self._stats[request.request_id] = KvPullStats(0, 0, cached_blocks, 0.0, outcome)
            self._resolved.add(request.request_id)
            self._release_remote(handle, request.request_id)
            return 0, False
        return handle.num_tokens - num_computed_tokens, True

    def pull_precheck(self, handle: KvHandle) -> KvPullOutcome | None:
        """Why a handle's KV cannot be used as it stands (None: it may be pulled)."""
        if handle.layout != self.layout:
            return KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH
        if self._clock() * 1000 >= handle.lease_deadline_unix_ms:
            return KvPullOutcome.RECOMPUTED_LEASE_EXPIRED
        return None

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if self.role is not KVRole.CONSUMER or num_external_tokens == 0:
            return
        self._resolved.add(request.request_id)
        handle: KvHandle = request.kv_transfer_params[REMOTE_HANDLE]
        source: KvSource = request.kv_transfer_params[REMOTE_SOURCE]
        block_size = self.layout.block_size
        first = (handle.num_tokens - num_external_tokens) // block_size
        last = math.ceil(handle.num_tokens / block_size)
        self._to_post.append(
            _Pull(
                request_id=request.request_id,
                handle=handle,
                source=source,
                local_block_ids=list(block_ids[first:last]),
                remote_block_ids=list(handle.block_ids[first:last]),
                num_cached_blocks=first,
            )
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        pulls, self._to_post = self._to_post, []
        return PullMetadata(requests=pulls)

    def _consumer_request_finished(self, request) -> tuple[bool, dict | None]:
        self._resolved.discard(request.request_id)
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return False, None
        # A READ may still be writing into these blocks: free them only once it is over.
        pull.is_aborted = True
        return True, None

    # ==== worker side (both roles) =============================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.agent.register_kv_caches(list(kv_caches.values()))

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for pull in getattr(metadata, "requests", ()):
            self._post(pull)

    def _post(self, pull: _Pull) -> None:
        self._pulls[pull.request_id] = pull
        try:
            if not self.agent.has_peer(pull.source.agent_name):
                self.agent.add_peer(pull.source)
            pull.transfer = self.agent.read_blocks(
                pull.source.agent_name,
                pull.remote_block_ids,
                pull.local_block_ids,
                # No NIXL notification: with one, DONE waits for the prefill engine's next poll;
                # ReleaseKv over gRPC is the confirmation that matters.
                notif_msg=None,
            )
        except (KvTransferError, ValueError) as exc:
            logger.warning("posting the pull of %s failed: %s", pull.request_id, exc)
            pull.error = str(exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.role is KVRole.PRODUCER:
            return self._producer_finished() or None, None
        self._poll_pulls()
        self._apply_confirmations()
        landed, self._landed = self._landed, set()
        ended, self._ended = self._ended, set()
        return ended or None, landed or None

    def _poll_pulls(self) -> None:
        now = time.monotonic()
        for pull in list(self._pulls.values()):
            if pull.is_confirming:
                continue
            if pull.error is None:
                state = self.agent.poll(pull.transfer)  # a READ may have completed when posted
                if state is TransferState.PENDING:
                    if now - pull.transfer.started_at <= self.transfer_timeout_s:
                        continue
                    if not self.agent.release(pull.transfer):
                        continue  # NIXL cannot cancel it yet: the blocks may still be written
                    pull.error = f"pull timed out after {self.transfer_timeout_s} s"
                else:
                    self.agent.release(pull.transfer)
                    if state is TransferState.ERROR:
                        pull.error = pull.transfer.error or "transfer failed"
            pull.is_confirming = True
            self._release_remote(pull.handle, pull.request_id)

    def on_release_result(self, request_id: str, intact: bool) -> None:
        """ReleaseKv's answer for a pull (any thread); intact=False also when the call failed."""
        with self._lock:
            self._confirmations[request_id] = intact
        self.wake()

    def _apply_confirmations(self) -> None:
        with self._lock:
            confirmations, self._confirmations = self._confirmations, {}
        for request_id, intact in confirmations.items():
            pull = self._pulls.pop(request_id, None)
            if pull is None:
                continue
            self._finish_pull(pull, intact)

    def _finish_pull(self, pull: _Pull, intact: bool) -> None:
        transfer = pull.transfer
        good = intact and pull.error is None and transfer is not None and transfer.state is TransferState.DONE
        if pull.is_aborted:
            self._ended.add(pull.request_id)
            return
        if good:
            outcome = KvPullOutcome.PULLED
        elif pull.error is None and transfer is not None and transfer.state is TransferState.DONE:
            outcome = KvPullOutcome.RECOMPUTED_LEASE_EXPIRED  # bytes arrived but the hold was gone
        else:
            outcome = KvPullOutcome.RECOMPUTED_ERROR
        if not good:
            # Never decode on KV not known good: the scheduler recomputes (or fails) from these blocks.
            self._bad_block_ids.update(pull.local_block_ids)
        self._stats[pull.request_id] = KvPullStats(
            num_bytes=transfer.num_bytes if transfer and good else 0,
            num_blocks=len(pull.local_block_ids) if good else 0,
            num_cached_blocks=pull.num_cached_blocks,
            seconds=(transfer.seconds or 0.0) if transfer else 0.0,
            outcome=outcome,
        )
        self._landed.add(pull.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_block_ids = self._bad_block_ids, set()
        return bad

    def _release_remote(self, handle: KvHandle, request_id: str) -> None:
        if self.release_remote is None:
            self.on_release_result(request_id, False)
        else:
            self.release_remote(handle, request_id)

    # ==== shared ==============================================================================
    def has_pending_work(self) -> bool:
        """True while the engine loop must keep stepping: holds to watch, pulls in flight, events to report."""
        with self._lock:
            producer_busy = bool(self._holds or self._released)
            consumer_busy = bool(self._confirmations)
        return producer_busy or consumer_busy or bool(self._pulls or self._landed or self._ended)

    def pop_pull_stats(self, request_id: str) -> KvPullStats | None:
        return self._stats.pop(request_id, None)

    def release_all(self) -> None:
        """End every hold (shutdown): the scheduler frees the blocks on its next step."""
        with self._lock:
            self._released |= set(self._holds)
            self._holds.clear()
        self.wake()

    def shutdown(self) -> None:
        self.release_all()
        self.agent.close()
