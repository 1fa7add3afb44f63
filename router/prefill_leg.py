"""The router's prefill leg: the prompt computed on one prefill pod (retried on others when one fails or
freezes) while a fresh probe confirms the decode pod the request continues on; token 1 and the KV hold
come back."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from router.flags import RouterConfig
from router.kv_index import PromptHashes
from router.metrics import RouterMetrics
from router.picking import Picker, no_pick_error
from router.retry import Stalled, retry_after_s
from router.route_call import ANSWER_MAY_BE_LOST, DROPPED, RETRYABLE, Hold, HoldReleases, RouteError, count_retry
from router.workers import Admission, WorkerPool
from shared.serving.wire import payloads as wire

logger = logging.getLogger(__name__)


class PrefillLeg:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, config: RouterConfig, picker: Picker,
                 holds: HoldReleases, metrics: RouterMetrics | None):
        self._prefill = prefill
        self._decode = decode
        self._config = config
        self._picker = picker
        self._holds = holds
        self._metrics = metrics

    async def run(self, request_id, prompt: PromptHashes, sampling, deadline) -> tuple[wire.PrefillResult, str, str | None]:
        """(prefill result, its pod, the decode pod to continue on): while the prompt computes, a fresh probe
        confirms the decode pod the request will go to, so token 1 never goes out for a request whose decode
        pod froze since its last periodic probe. A refusal that comes first ends the prefill call too (an
        overloaded tier does not spend prefill work on requests it refuses). The decode pod is None when
        token 1 ends the request."""
        admission = asyncio.ensure_future(self._admitting_decode(prompt))
        prefill = asyncio.ensure_future(self._prefill_on_some_pod(request_id, prompt, sampling, deadline))
        try:
            await asyncio.wait({admission, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done() and admission.exception() is not None:
                prefill.cancel()  # a hold it made meanwhile is released as an unclaimed answer's
                await asyncio.gather(prefill, return_exceptions=True)
                raise admission.exception()
            result, prefill_address = await prefill
        except BaseException:
            admission.cancel()
            prefill.cancel()
            raise
        if not result.hands_off:
            admission.cancel()
            return result, prefill_address, None
        try:
            return result, prefill_address, await admission
        except BaseException:
            self._holds.abandon(Hold(prefill_address, request_id, result.handle))  # no token 1 went out
            raise

    async def _admitting_decode(self, prompt: PromptHashes) -> str:
        """A decode pod, picked as the decode leg would pick it, that a fresh probe finds serving and not
        overloaded. When none is: RESOURCE_EXHAUSTED with a retry hint if any refused as overloaded (busy, or
        silent while busy: the client comes back later), UNAVAILABLE if none serves."""
        refused: list[str] = []
        is_overloaded = False
        while True:
            choice = self._picker.pick(self._decode, refused, prompt)
            if choice.address is None:
                if is_overloaded:
                    raise self._overloaded_error(refused)
                raise no_pick_error(self._decode, choice.reason, None, refused)
            admission = await self._decode.admits(choice.address)
            if admission is Admission.ADMITTED:
                return choice.address
            is_overloaded |= admission is Admission.OVERLOADED
            refused.append(choice.address)

    def _overloaded_error(self, refused: list[str]) -> RouteError:
        return RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"every decode worker is overloaded ({len(refused)} refused this request)",
                         ", ".join(refused), retry_after_s=self._decode.retry_after_s())

    async def _prefill_on_some_pod(self, request_id, prompt: PromptHashes, sampling, deadline):
        tried: list[str] = []
        last_error = None
        reason = None
        for _ in range(1 + self._config.max_prefill_retries):
            choice = self._picker.pick(self._prefill, tried, prompt)
            if choice.address is None:
                reason = choice.reason
                break
            tried.append(choice.address)
            try:
                result = await self._call_prefill(choice.address, request_id, prompt.token_ids, sampling, deadline)
                return result, choice.address
            except ValueError as exc:
                raise RouteError(
                    grpc.StatusCode.INTERNAL, f"a prefill worker sent a bad response: {exc}", choice.address
                ) from None
            except Stalled as exc:
                last_error = exc
                cause = str(exc)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise RouteError(exc.code(), exc.details(), choice.address) from None
                if exc.code() in DROPPED:
                    self._prefill.mark_unavailable(choice.address)
                else:
                    self._prefill.mark_overloaded(choice.address, retry_after_s(exc))
                last_error = exc
                cause = str(exc.code())
            count_retry(self._metrics, "prefill")
            logger.warning("request %s: prefill on %s failed (%s), retrying", request_id, choice.address, cause)
        raise no_pick_error(self._prefill, reason, last_error, tried)

    async def _call_prefill(self, address, request_id, prompt_ids, sampling, deadline):
        """One Prefill call; Stalled when it has no answer after stall_timeout_s and the pod fails its
        health probes too (frozen: a pod busy computing a long queue still answers them, and one slow
        probe alone does not give up a call about to be answered)."""
        stalled_at = time.monotonic() + self._config.stall_timeout_s
        # In flight on the worker until answered: a worker that leaves the rotation meanwhile (scaled down)
        # keeps its channel open for this call.
        with self._prefill.use(address) as client:
            call = asyncio.ensure_future(
                client.prefill(request_id, prompt_ids, sampling, timeout_s=deadline.remaining())
            )
            is_answered = False
            try:
                while True:
                    done, _ = await asyncio.wait({call}, timeout=self._prefill.config.health_interval_s)
                    if done:
                        result = call.result()  # raises the call's error: then the finally below runs
                        is_answered = True
                        return result
                    if time.monotonic() >= stalled_at and not self._prefill.is_healthy(address):
                        raise Stalled(f"no answer for {self._config.stall_timeout_s} s, and the worker fails its "
                                      "health probes")
            finally:
                if not is_answered:
                    # The answer may already be on its way; the hold it names must not wait for its lease.
                    call.add_done_callback(lambda done: self._release_unclaimed(address, request_id, done))
                    call.cancel()

    def _release_unclaimed(self, address: str, request_id: str, call: asyncio.Future) -> None:
        """A Prefill call whose answer the request will not use: end the hold the pod may have made."""
        if not call.cancelled() and call.exception() is None:
            result = call.result()
            if result.handle is not None:
                self._holds.abandon(Hold(address, request_id, result.handle))
            return
        error = None if call.cancelled() else call.exception()
        if error is None or (isinstance(error, grpc.aio.AioRpcError) and error.code() in ANSWER_MAY_BE_LOST):
            # The pod may have answered, and made its hold, just as the call ended here: the answer is
            # lost, but the request id still names the hold.
            self._holds.spawn(self._holds.release(address, request_id))
