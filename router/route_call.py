"""What both legs of one routed call share: the error that ends the client's call, the client's deadline,
the status groups a leg retries on, and the prefill pod's KV hold between the legs with its release."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from router.metrics import RouterMetrics
from router.workers import WorkerPool
from shared.engine.kv_transfer.handle import KvHandle, KvPullOutcome
from shared.serving.pod.outcomes import RETRY_AFTER_KEY

logger = logging.getLogger(__name__)

# A call the worker or the connection to it dropped (the router's own caller going away cancels the router's
# task instead, never ends a call with a status): the work is redone elsewhere.
DROPPED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# Failures that mean "this worker could not take the call": try another one.
RETRYABLE = (*DROPPED, grpc.StatusCode.RESOURCE_EXHAUSTED)
# How a Prefill call can end here after the pod finished it: the pod's answer (and the handle of the hold
# it made) never reached the router.
ANSWER_MAY_BE_LOST = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# Pull outcomes after which the decode pod did not use the hold: the router ends it too (ReleaseKv is
# idempotent), since a pod that could not read the blocks may not reach the prefill pod at all.
HOLD_UNUSED = (KvPullOutcome.RECOMPUTED_ERROR, KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH)


class RouteError(Exception):
    """Ends the client's call with this status. The message goes to the client; where (the workers
    involved) only to the router's log: callers need not learn the deployment's addresses."""

    def __init__(self, code: grpc.StatusCode, message: str, where: str | None = None,
                 retry_after_s: float | None = None):
        """retry_after_s: when a retry may succeed (an overloaded tier); sent as the pods send it."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.where = where
        self.retry_after_s = retry_after_s

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_s is None:
            return ()
        return ((RETRY_AFTER_KEY, str(max(1, round(self.retry_after_s * 1000)))),)


class Deadline:
    """The client's deadline, as a timeout for each downstream call."""

    def __init__(self, remaining_s: float | None):
        self._at = None if remaining_s is None else time.monotonic() + remaining_s

    def remaining(self) -> float | None:
        if self._at is None:
            return None
        left = self._at - time.monotonic()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded in the router")
        return left


def count_retry(metrics: RouterMetrics | None, tier: str) -> None:
    if metrics is not None:
        metrics.retries.labels(tier=tier).inc()


@dataclass
class Hold:
    """A prefill pod's KV hold for one request; settled once a decode pod has confirmed (or the router
    gave it up), after which no decode attempt may carry the handle."""

    prefill_address: str
    request_id: str
    handle: KvHandle
    is_settled: bool = False


class HoldReleases:
    """Ends holds no decode pod confirmed, at once rather than at their lease's end, in tasks that outlive
    the request's own (which may be being cancelled)."""

    def __init__(self, prefill: WorkerPool):
        self._prefill = prefill
        self._background: set[asyncio.Task] = set()

    def spawn(self, coroutine) -> None:
        # Runs even when the request's task is being cancelled; a reference keeps it from being collected.
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abandon(self, hold: Hold | None) -> None:
        """Gives up the hold (once): later decode attempts recompute, and the prefill pod frees the blocks."""
        if hold is None or hold.is_settled:
            return
        hold.is_settled = True
        self.spawn(self.release(hold.prefill_address, hold.request_id, hold.handle.engine_id))

    async def release(self, address: str, request_id: str, engine_id: str = "") -> None:
        """Ends the request's hold on the prefill pod at address; engine_id "": whichever engine it runs now."""
        try:
            with self._prefill.use(address) as client:
                await client.release_kv(request_id, engine_id)
        except (grpc.aio.AioRpcError, LookupError) as exc:
            # The lease expiry frees the blocks anyway; this only makes it sooner.
            logger.info("request %s: releasing the KV hold on %s failed: %s", request_id, address, exc)

    async def drain(self) -> None:
        """Waits for pending releases (called at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
