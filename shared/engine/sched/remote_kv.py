"""Requests whose KV crosses engines, as the scheduler tracks them: loads in flight
(WAITING_FOR_REMOTE_KVS), finished producer requests whose blocks a peer still reads, loads cut
short by an abort, and what a failed load does under the kv-load-failure policy.
"""
from __future__ import annotations

from collections.abc import Iterable

from shared.engine.kv_cache.manager import KVCacheManager
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy
from shared.engine.request import Request, RequestStatus
from shared.engine.sched.output import KVConnectorOutput


class RemoteKvTracker:
    """The scheduler's remote-KV state; it frees blocks through the KV-cache manager it shares."""

    def __init__(self, kv_cache_manager: KVCacheManager, failure_policy: KVLoadFailurePolicy | None) -> None:
        """failure_policy: the connector's (None without one: nothing loads remotely)."""
        self.kv_cache_manager = kv_cache_manager
        self.failure_policy = None if failure_policy is None else KVLoadFailurePolicy(failure_policy)
        # Remote KV landed for these (WAITING_FOR_REMOTE_KVS requests become schedulable).
        self._finished_recving: set[str] = set()
        # Finished producer requests whose blocks a peer still reads (freed on finished_sending).
        self._held: dict[str, Request] = {}
        # Aborted while their KV load was in flight: blocks freed when the load reports done.
        self._abandoned_loads: dict[str, Request] = {}

    # ---- loads --------------------------------------------------------------------------------
    @staticmethod
    def start_load(request: Request, num_computed_tokens: int) -> None:
        """The request waits for its asynchronous load; num_computed_tokens count once it lands."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_pending_computed_tokens = num_computed_tokens

    def promote(self, request: Request) -> bool:
        """A WAITING_FOR_REMOTE_KVS request whose load finished becomes an ordinary waiting request."""
        req_id = request.request_id
        if req_id not in self._finished_recving:
            return False
        self._finished_recving.discard(req_id)
        num_computed = min(request.num_pending_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING
        return True

    def triage_load_failures(
        self, requests: Iterable[Request], bad_block_ids: set[int]
    ) -> tuple[list[Request], list[Request]]:
        """Requests touching blocks whose load failed: (to fail, running ones to recompute). A request
        still waiting for its load recomputes from the first bad block, so it is settled here."""
        to_fail: list[Request] = []
        to_recompute: list[Request] = []
        for request in requests:
            first_bad = self.kv_cache_manager.invalidate_blocks(request, bad_block_ids)
            if first_bad is None:
                continue
            if self.failure_policy == KVLoadFailurePolicy.FAIL:
                to_fail.append(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.num_pending_computed_tokens = min(
                    request.num_pending_computed_tokens, first_bad * self.kv_cache_manager.block_size
                )
            elif request.status == RequestStatus.RUNNING:
                to_recompute.append(request)
        return to_fail, to_recompute

    # ---- retiring -----------------------------------------------------------------------------
    def retire(self, request: Request, delay_free: bool, load_in_flight: bool) -> None:
        """Free a finished request's blocks now, or keep them while a peer reads them (delay_free)
        or while its own load may still write into them."""
        req_id = request.request_id
        if req_id in self._finished_recving:
            load_in_flight = False  # the load already landed
            self._finished_recving.discard(req_id)
        if delay_free:
            self._held[req_id] = request
        elif load_in_flight:
            self._abandoned_loads[req_id] = request
        else:
            self.kv_cache_manager.free(request)

    def apply_connector_output(self, kv_output: KVConnectorOutput, live_request_ids) -> None:
        """Landed loads make their requests schedulable; ended sends and abandoned loads free blocks."""
        for req_id in kv_output.finished_recving or ():
            abandoned = self._abandoned_loads.pop(req_id, None)
            if abandoned is not None:
                self.kv_cache_manager.free(abandoned)
            elif req_id in live_request_ids:
                self._finished_recving.add(req_id)
        for req_id in kv_output.finished_sending or ():
            held = self._held.pop(req_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)

    # ---- holds for a peer ---------------------------------------------------------------------
    def is_held(self, req_id: str) -> bool:
        return req_id in self._held

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    @property
    def num_held_blocks(self) -> int:
        return sum(self.kv_cache_manager.get_num_blocks(req_id) for req_id in self._held)

    def release_held(self, request_ids: Iterable[str] | None = None) -> set[str]:
        """Free held blocks without waiting for the connector; None releases every hold."""
        ids = list(self._held) if request_ids is None else [r for r in request_ids if r in self._held]
        for req_id in ids:
            self.kv_cache_manager.free(self._held.pop(req_id))
        return set(ids)
