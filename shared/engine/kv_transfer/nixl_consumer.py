"""The decode side of the NIXL handoff: pull a prompt's blocks with NIXL READs, confirm the hold
with the prefill pod (ReleaseKv), and let the scheduler use the blocks only when it was intact.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from shared.engine.kv_transfer.connector import KVConnectorMetadata, KVRole
from shared.engine.kv_transfer.handle import (
    KvHandle, KvHandleNotAuthentic, KvHandleOtherPrompt, KvPullOutcome, KvPullStats, KvSource,
)
from shared.engine.kv_transfer.handoff import PullFromPeer
from shared.engine.kv_transfer.nixl_connector import NixlConnector
from shared.engine.kv_transfer.transfer import KvTransfer, KvTransferError, TransferState
from shared.engine.request import Request

logger = logging.getLogger(__name__)

# How long a pull may take before it counts as stuck (cancelled, the prompt recomputed): the time its bytes
# take at a rate far below any network P/D runs on, at least a floor, and never past its hold's lease (the
# bytes cannot be used after it). A stalled transport then costs seconds, not half a minute.
_SLOWEST_PULL_BYTES_PER_S = 50 * 2**20
_MIN_PULL_TIMEOUT_S = 5.0
_MIN_LEASE_LEFT_S = 1.0  # even a lease about to end leaves a pull this long


# ReleaseKv's answer for a pull: (request id, intact); intact None when the call got no answer.
OnReleaseResult = Callable[[str, bool | None], None]
# Asks the prefill pod holding a pull's blocks to end the hold (ReleaseKv) off the engine thread, then answers
# on_result: (handle, request id, prompt digest, on_result).
ConfirmRelease = Callable[[KvHandle, str, bytes, OnReleaseResult], None]


@dataclass
class _Pull:
    """One request's pull, from allocation to the confirmed (or refused) release."""

    request_id: str
    handle: KvHandle
    source: KvSource
    local_block_ids: list[int]
    remote_block_ids: list[int]
    num_cached_blocks: int
    prompt_digest: bytes
    transfer: KvTransfer | None = None
    is_aborted: bool = False  # the request ended while its READ was in flight
    is_confirming: bool = False  # READ over (or abandoned), ReleaseKv asked
    error: str | None = None
    timeout_s: float = _MIN_PULL_TIMEOUT_S  # set when posted (_pull_timeout_s)


@dataclass
class PullMetadata(KVConnectorMetadata):
    """This step's pulls to post."""

    requests: list[_Pull] = field(default_factory=list)


class NixlConsumer(NixlConnector):
    """Pulls prompts' KV from prefill pods. on_release_result() may run on any thread."""

    def __init__(self, *, confirm_release: ConfirmRelease | None, **kwargs):
        """confirm_release: how a pull's hold is confirmed with its prefill pod (the decode pod's KvSourceCache);
        None: nothing can ask one, so no pull is ever known good."""
        super().__init__(KVRole.CONSUMER, **kwargs)
        self._confirm_release = confirm_release
        self._to_post: list[_Pull] = []
        self._pulls: dict[str, _Pull] = {}  # posted, not yet confirmed
        self._confirmations: dict[str, bool | None] = {}  # request id -> intact, from ReleaseKv (None: no answer)
        self._landed: set[str] = set()
        self._ended: set[str] = set()  # aborted mid-pull, now safe to free
        self._bad_block_ids: set[int] = set()
        self._decided: dict[str, KvPullStats] = {}  # pulls decided since the last get_pull_stats()
        # Requests whose one pull attempt is decided: a resumed (preempted) request recomputes.
        self._resolved: set[str] = set()

    def check_handle(self, handle: KvHandle, prompt_digest: bytes) -> None:
        """Refuse a handle no prefill pod of this deployment minted (KvHandleNotAuthentic), or one
        minted for another prompt than the request's (KvHandleOtherPrompt). Asked where the handle
        enters the pod, before anything is read with it."""
        if not self.signer.is_authentic(handle):
            raise KvHandleNotAuthentic(
                "the KV handle's signature does not verify: it was not minted by a prefill pod sharing this "
                "pod's handle key, or it was altered"
            )
        if handle.prompt_digest != prompt_digest:
            raise KvHandleOtherPrompt("the KV handle was issued for another prompt than this request's")

    def pull_precheck(self, handle: KvHandle) -> KvPullOutcome | None:
        """Why a handle's KV cannot be used as it stands (None: it may be pulled). The decode
        servicer asks once, where the handle enters the pod, before it builds a PullFromPeer."""
        if handle.layout != self.layout:
            return KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH
        if self._clock() * 1000 >= handle.lease_deadline_unix_ms:
            return KvPullOutcome.RECOMPUTED_LEASE_EXPIRED
        return None

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, PullFromPeer) or request.request_id in self._resolved:
            return 0, False
        handle = params.handle
        if handle.num_tokens > num_computed_tokens:
            return handle.num_tokens - num_computed_tokens, True
        # The local prefix cache already has the whole prompt: nothing to read, end the hold now.
        cached_blocks = num_computed_tokens // self.layout.block_size
        self._decided[request.request_id] = KvPullStats(0, 0, cached_blocks, 0.0, KvPullOutcome.PREFIX_CACHE_HIT)
        self._resolved.add(request.request_id)
        self._release_remote(handle, request.request_id, params.prompt_digest)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        self._resolved.add(request.request_id)
        params: PullFromPeer = request.kv_transfer_params
        handle = params.handle
        block_size = self.layout.block_size
        first = (handle.num_tokens - num_external_tokens) // block_size
        last = math.ceil(handle.num_tokens / block_size)
        self._to_post.append(
            _Pull(
                request_id=request.request_id,
                handle=handle,
                source=params.source,
                local_block_ids=list(block_ids[first:last]),
                remote_block_ids=list(handle.block_ids[first:last]),
                num_cached_blocks=first,
                prompt_digest=params.prompt_digest,
            )
        )

    def build_connector_meta(self, scheduler_output) -> PullMetadata:
        pulls, self._to_post = self._to_post, []
        return PullMetadata(requests=pulls)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._resolved.discard(request.request_id)
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return False, None
        # A READ may still be writing into these blocks: free them only once it is over.
        pull.is_aborted = True
        if pull.is_confirming:
            self._end_aborted(pull)
        return True, None

    def has_pending_work(self) -> bool:
        with self._lock:
            if self._confirmations:
                return True
        return bool(self._pulls or self._landed or self._ended)

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self, metadata: PullMetadata) -> None:
        for pull in metadata.requests:
            self._post(pull)

    def _post(self, pull: _Pull) -> None:
        self._pulls[pull.request_id] = pull
        pull.timeout_s = self._pull_timeout_s(pull)
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
            # Every READ counts, its data used or not: a pull later found bad read memory all the same.
            with self._lock:
                self.num_reads += 1
                self.num_read_bytes += pull.transfer.num_bytes
        except (KvTransferError, ValueError) as exc:
            logger.warning("posting the pull of %s failed: %s", pull.request_id, exc)
            pull.error = str(exc)

    def _pull_timeout_s(self, pull: _Pull) -> float:
        num_bytes = len(pull.remote_block_ids) * pull.source.block_bytes * max(1, len(pull.source.regions))
        lease_left_s = pull.handle.lease_deadline_unix_ms / 1000 - self._clock()
        bytes_time_s = max(_MIN_PULL_TIMEOUT_S, num_bytes / _SLOWEST_PULL_BYTES_PER_S)
        return max(_MIN_LEASE_LEFT_S, min(lease_left_s, bytes_time_s))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
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
                    if now - pull.transfer.started_at <= pull.timeout_s:
                        continue
                    if not self.agent.release(pull.transfer):
                        continue  # NIXL cannot cancel it yet: the blocks may still be written
                    pull.error = f"not done within {pull.timeout_s:.1f} s"
                else:
                    self.agent.release(pull.transfer)
                    if state is TransferState.ERROR:
                        pull.error = pull.transfer.error or "transfer failed"
                if pull.error is not None:
                    # Loud, not only a recompute: a transport that stops delivering shows in the log.
                    logger.warning("the KV pull of %s from %s (NIXL agent %s) failed: %s; recomputing the prompt",
                                   pull.request_id, pull.handle.source_address, pull.source.agent_name, pull.error)
            pull.is_confirming = True
            self._release_remote(pull.handle, pull.request_id, pull.prompt_digest)
            if pull.is_aborted:
                self._end_aborted(pull)

    def _end_aborted(self, pull: _Pull) -> None:
        """The READ of an aborted request is over: nothing writes into its blocks any more, so they are
        freed now; the confirmation under way only ends the prefill pod's hold."""
        del self._pulls[pull.request_id]
        self._ended.add(pull.request_id)

    def on_release_result(self, request_id: str, intact: bool | None) -> None:
        """ReleaseKv's answer for a pull (any thread); intact None when the call got no answer (the hold
        may still stand: the outcome says error, so the router ends it)."""
        with self._lock:
            self._confirmations[request_id] = intact
        self.wake()

    def _apply_confirmations(self) -> None:
        with self._lock:
            confirmations, self._confirmations = self._confirmations, {}
        for request_id, intact in confirmations.items():
            pull = self._pulls.pop(request_id, None)
            if pull is not None:
                self._finish_pull(pull, intact)

    def _finish_pull(self, pull: _Pull, intact: bool | None) -> None:
        transfer = pull.transfer
        arrived = pull.error is None and transfer is not None and transfer.state is TransferState.DONE
        good = intact is True and arrived
        if good:
            outcome = KvPullOutcome.PULLED
        elif arrived and intact is False:
            outcome = KvPullOutcome.RECOMPUTED_LEASE_EXPIRED  # bytes arrived but the hold was gone
        else:
            # The transfer failed, or the prefill pod could not be asked whether its hold stood.
            outcome = KvPullOutcome.RECOMPUTED_ERROR
        if not good:
            # Never decode on KV not known good: the scheduler recomputes (or fails) from these blocks.
            self._bad_block_ids.update(pull.local_block_ids)
        self._decided[pull.request_id] = KvPullStats(
            num_bytes=transfer.num_bytes if transfer is not None else 0,
            num_blocks=len(pull.local_block_ids) if good else 0,
            num_cached_blocks=pull.num_cached_blocks,
            seconds=(transfer.seconds or 0.0) if transfer else 0.0,
            outcome=outcome,
        )
        self._landed.add(pull.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_block_ids = self._bad_block_ids, set()
        return bad

    def _release_remote(self, handle: KvHandle, request_id: str, prompt_digest: bytes) -> None:
        if self._confirm_release is None:
            self.on_release_result(request_id, None)  # nothing can ask the prefill pod
        else:
            self._confirm_release(handle, request_id, prompt_digest, self.on_release_result)

    def get_pull_stats(self) -> dict[str, KvPullStats]:
        decided, self._decided = self._decided, {}
        return decided
