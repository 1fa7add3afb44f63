"""The router's decode leg: the request continued on a decode pod (with the prefill pod's KV handle, or
computing the prompt itself), its tokens relayed; a pod that refuses is tried again after a backoff, one
that fails or freezes mid-stream is replaced without a duplicated or missing token."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry import trace

from router.flags import RouterConfig
from router.kv_index import PromptHashes
from router.metrics import RouterMetrics
from router.picking import Picker, no_pick_error
from router.policy import Pick
from router.retry import Backoff, Stalled, retry_after_s
from router.route_call import DROPPED, HOLD_UNUSED, Hold, HoldReleases, RouteError, count_retry
from router.workers import WorkerPool
from shared.engine.kv_transfer.handle import KvPullStats
from shared.engine.request import FinishReason
from shared.serving.wire.decode import decode_chunk_from_proto, decode_request_to_proto
from shared.serving.wire import payloads as wire

logger = logging.getLogger(__name__)


async def _await_status(call, timeout_s: float) -> None:
    """The status of a call whose last message came; cancelled if it does not follow within timeout_s."""
    try:
        await asyncio.wait_for(call.code(), timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        call.cancel()


@dataclass
class _Attempts:
    """One request's decode attempts so far."""

    backoff: Backoff
    # Pods that failed or froze on this request: marked unavailable, so not picked again until a health
    # probe finds them serving (a false stall, e.g. while the router itself was starved).
    failed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # overloaded since the last backoff
    last_error: Exception | None = None


class DecodeLeg:
    def __init__(self, decode: WorkerPool, config: RouterConfig, picker: Picker, holds: HoldReleases,
                 metrics: RouterMetrics | None):
        self._decode = decode
        self._config = config
        self._picker = picker
        self._holds = holds
        self._metrics = metrics

    async def run(self, request_id, prompt: PromptHashes, sampling, generated: list[int], deadline,
                  hold: Hold | None, admitted: str | None = None):
        """Yields DecodeChunks with tokens or a finish reason. `generated` (token 1 first, or empty without a
        prefill) grows as tokens are yielded, so a re-issue after a failure carries exactly what the
        client already has. Without a hold the decode pod computes the prompt itself (and its prompt
        logprobs, until the client has the first token). A pod that refuses (overloaded) is tried again
        after a backoff; one that fails or freezes is not. admitted: the decode pod confirmed before token 1
        went out, tried first while it can still be picked."""
        attempts = _Attempts(Backoff(self._config.decode_admit_timeout_s))
        while True:
            if "max_tokens" not in sampling.unset and len(generated) >= sampling.max_tokens:
                # A pod died right after the last token but before saying so: the request is complete.
                yield wire.DecodeChunk(finish_reason=FinishReason.LENGTH)
                return
            choice = self._pick(attempts.refused, prompt, admitted)
            admitted = None
            if choice.address is None:
                if not attempts.backoff.can_wait(deadline):
                    raise no_pick_error(self._decode, choice.reason, attempts.last_error,
                                        attempts.failed + attempts.refused)
                await attempts.backoff.wait(deadline)
                attempts.refused.clear()
                continue
            carries_handle = hold is not None and not hold.is_settled
            # Prompt logprobs come with the first token (from prefill, else from this pod): once it is out, none.
            work = wire.DecodeInput(
                request_id, prompt.token_ids, list(generated),
                replace(sampling, prompt_logprobs=None) if generated else sampling,
                hold.handle if carries_handle else None,
            )
            try:
                # Closed at once when the client goes away: that cancels the Decode call.
                attempt = self._decode_on(choice.address, work, generated, deadline, hold)
                async with aclosing(attempt) as tokens:
                    async for decoded in tokens:
                        attempts.backoff.reset()
                        yield decoded
                return
            except (grpc.aio.AioRpcError, Stalled) as exc:
                self._after_failure(exc, choice.address, work, hold, attempts)

    def _after_failure(self, error: Exception, address: str, work: wire.DecodeInput, hold: Hold | None,
                       attempts: _Attempts) -> None:
        """Decides what follows a failed attempt (returns to try again, or raises RouteError)."""
        attempts.last_error = error
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint_s = retry_after_s(error)
            self._decode.mark_overloaded(address, hint_s)
            attempts.refused.append(address)
            attempts.backoff.hint(hint_s)
            return
        if code == grpc.StatusCode.PERMISSION_DENIED and work.handle is not None:
            # The handle came from this deployment's own prefill pod: the pods' KV handle keys
            # differ. The tokens so far are good; the decode pod recomputes the prompt instead.
            logger.error("request %s: decode pod %s refused the KV handle of prefill pod %s (%s): the "
                         "pods' --kv-handle-key-file / PDSERVE_KV_HANDLE_KEY differ; recomputing",
                         work.request_id, address, hold.prefill_address, error.details())
            self._holds.abandon(hold)
            count_retry(self._metrics, "decode")
            return
        if code is not None and code not in DROPPED:
            raise RouteError(code, error.details(), address) from None
        # The pod died or froze, maybe mid-pull: never hand the same KV to another pod; recompute.
        self._decode.mark_unavailable(address)
        self._holds.abandon(hold)
        attempts.failed.append(address)
        count_retry(self._metrics, "decode")
        if len(attempts.failed) > self._config.max_decode_retries:
            raise no_pick_error(self._decode, None, error, attempts.failed)
        logger.warning("request %s: decode on %s failed (%s) after %d tokens, re-issuing", work.request_id,
                       address, error if code is None else str(code), len(work.generated_token_ids))

    def _pick(self, refused: list[str], prompt: PromptHashes, admitted: str | None) -> Pick:
        # The pod admitted before token 1 takes the request while it serves: an overload it reported since
        # is for new requests (a continuation is queued there, never refused for its wait).
        if admitted is not None and admitted not in refused and self._decode.is_healthy(admitted):
            return Pick(admitted)
        return self._picker.pick(self._decode, refused, prompt)

    async def _decode_on(self, address: str, work: wire.DecodeInput, generated: list[int], deadline,
                         hold: Hold | None):
        """One Decode call: yields its chunks with tokens or a finish reason, until the finish reason."""
        with self._decode.use(address) as stub:
            call = stub.Decode(decode_request_to_proto(work), timeout=deadline.remaining())
            finished = False
            try:
                is_first = True
                while True:
                    response = await self._next_message(call, address, deadline, is_first)
                    if response is grpc.aio.EOF:
                        break
                    self._decode.note_heard(address)
                    decoded = self._decode_chunk(address, response)
                    if is_first:
                        is_first = False
                        # The first message comes after the pull was confirmed (or given up).
                        if decoded.kv_pull is not None and decoded.kv_pull.outcome in HOLD_UNUSED:
                            # The pod recomputed: it may not reach the prefill pod to end the hold itself.
                            self._holds.abandon(hold)
                        elif hold is not None:
                            hold.is_settled = True
                        self._record_pull(work.request_id, decoded.kv_pull)
                    generated.extend(decoded.token_ids)
                    finished = decoded.finish_reason is not None
                    if decoded.token_ids or finished:
                        yield decoded
                    if finished:
                        return
            finally:
                if finished:  # the pod's OK status follows at once: take it, or the call would end CANCELLED
                    self._holds.spawn(_await_status(call, self._config.stall_timeout_s))
                else:
                    call.cancel()  # reaches the decode pod when the client went away
        raise RouteError(grpc.StatusCode.INTERNAL, "a decode worker ended the stream without a finish reason", address)

    async def _next_message(self, call, address: str, deadline, is_first: bool):
        """The call's next message (or EOF); Stalled when the pod sends nothing for stall_timeout_s
        while the client's deadline has longer to run, and it fails its health probes, or (after the
        first message) has nothing waiting either. Before the first message (which waits for the KV pull),
        and while requests wait in its queue (this one may be among them, or preempted), a pod that still
        passes its health probes is only slow, not frozen."""
        read = asyncio.ensure_future(call.read())
        try:
            while True:
                remaining = deadline.remaining()
                if remaining is not None and remaining <= self._config.stall_timeout_s:
                    return await read  # the call's own deadline ends it
                done, _ = await asyncio.wait({read}, timeout=self._config.stall_timeout_s)
                if done:
                    return read.result()
                is_frozen = not self._decode.is_healthy(address)
                is_idle_yet_silent = not is_first and not self._decode.has_waiting(address)
                if is_frozen or is_idle_yet_silent:
                    raise Stalled(f"no token for {self._config.stall_timeout_s} s")
        finally:
            if not read.done():
                read.cancel()

    @staticmethod
    def _decode_chunk(address: str, response) -> wire.DecodeChunk:
        try:
            return decode_chunk_from_proto(response)
        except ValueError as exc:
            raise RouteError(grpc.StatusCode.INTERNAL, f"a decode worker sent a bad message: {exc}", address) from None

    def _record_pull(self, request_id: str, stats: KvPullStats | None) -> None:
        if stats is None:
            return
        logger.debug("request %s: kv pull %s, %d blocks, %d bytes in %.4fs", request_id,
                     stats.outcome.value, stats.num_blocks, stats.num_bytes, stats.seconds)
        span = trace.get_current_span()
        span.set_attribute("pdserve.kv_pull.outcome", stats.outcome.value)
        span.set_attribute("pdserve.kv_pull.num_bytes", stats.num_bytes)
        span.set_attribute("pdserve.kv_pull.num_blocks", stats.num_blocks)
        if self._metrics is not None:
            self._metrics.kv_pulls.labels(outcome=stats.outcome.value).inc()
