"""The public Generate RPC: validate, prefill on one pod (token 1 streamed at once), decode on another,
relay tokens; retries, deadline and cancellation propagation, and KV-hold cleanup live here."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from proto.pdserve.v1 import generate_pb2_grpc
from router.flags import RouterConfig
from router.kv_index import KvIndex, PromptHashes
from router.metrics import RouterMetrics
from router.policy import NoPick, Route, RouteDecision, RouteReason, candidates, decide_route, pick
from router.retry import Backoff, Stalled, retry_after_s
from shared.serving.text import TextCodec
from router.workers import WorkerPool
from shared.serving import convert, fan_out, wire
from shared.serving.output_text import OutputText
from shared.engine.kv_transfer.handle import KvHandle, KvPullOutcome, KvPullStats
from shared.engine.request import FinishReason, SamplingParams
from shared.serving.generate_rpc import serve_generate
from shared.serving.generation import CallEnded, GenerateChunk, GenerateInput, OnEnd, prompt_token_ids
from shared.serving.outcomes import (
    CANCELLED, ERROR, INVALID, OK, RETRY_AFTER_KEY, outcome_of_code, prompt_too_long,
)

logger = logging.getLogger(__name__)

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


async def _await_status(call, timeout_s: float) -> None:
    """The status of a call whose last message came; cancelled if it does not follow within timeout_s."""
    try:
        await asyncio.wait_for(call.code(), timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        call.cancel()


class _Deadline:
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


# Pull outcomes after which the decode pod did not use the hold: the router ends it too (ReleaseKv is
# idempotent), since a pod that could not read the blocks may not reach the prefill pod at all.
_HOLD_UNUSED = (KvPullOutcome.RECOMPUTED_ERROR, KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH)


@dataclass
class _Hold:
    """A prefill pod's KV hold for one request; settled once a decode pod has confirmed (or the router
    gave it up), after which no decode attempt may carry the handle."""

    prefill_address: str
    request_id: str
    handle: KvHandle
    is_settled: bool = False


# A call the worker or the connection to it dropped (the router's own caller going away cancels the router's
# task instead, never ends a call with a status): the work is redone elsewhere.
_DROPPED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# Failures that mean "this worker could not take the call": try another one.
_RETRYABLE = (*_DROPPED, grpc.StatusCode.RESOURCE_EXHAUSTED)
# How a Prefill call can end here after the pod finished it: the pod's answer (and the handle of the hold
# it made) never reached the router.
_ANSWER_MAY_BE_LOST = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _no_cleanup(cleanup) -> None:
    """A caller whose call ends only by closing the generator (whose finally frees the hold)."""


class RouterServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        config: RouterConfig,
        codec: TextCodec | None = None,
        metrics: RouterMetrics | None = None,
        tracer: trace.Tracer | None = None,
        kv_index: KvIndex | None = None,
    ):
        self._prefill = prefill
        self._decode = decode
        self._config = config
        self._codec = codec
        self._metrics = metrics
        self._tracer = tracer or trace.NoOpTracer()
        self._kv_index = kv_index
        self._turns = {prefill.tier: 0, decode.tier: 0}
        self._background: set[asyncio.Task] = set()

    # ---- the call ------------------------------------------------------------------------------
    async def Generate(self, request, context):
        """The gRPC call: a proto adapter over generate()."""
        async for message in serve_generate(self.generate, request, context, on_invalid=self._count_invalid):
            yield message

    async def generate(self, work: GenerateInput, *, on_end: OnEnd | None = None) -> AsyncIterator[GenerateChunk]:
        """One request's chunks (n completions interleaved, labelled by index); CallEnded with its status
        when it fails. on_end: registers the cleanup of a KV hold for when the caller's call ends."""
        request_id = work.request_id or uuid.uuid4().hex
        # Pods key holds by request id, and two clients may pick the same one: suffix it downstream.
        pod_request_id = f"{request_id}.{uuid.uuid4().hex[:8]}" if work.request_id else request_id
        start = time.monotonic()
        on_end = on_end or _no_cleanup
        outcome = ERROR
        num_output_tokens = 0
        try:
            prompt_ids, sampling = await self._validate(work)
            # The server span (from the tracing interceptor or the HTTP front, when on) is current here.
            span = trace.get_current_span()
            span.set_attribute("pdserve.request_id", pod_request_id)
            span.set_attribute("pdserve.num_prompt_tokens", len(prompt_ids))
            if "max_tokens" not in sampling.unset:  # else the pods fill it from the checkpoint
                span.set_attribute("pdserve.max_tokens", sampling.max_tokens)
            if self._metrics is not None:
                self._metrics.prompt_tokens.observe(len(prompt_ids) * sampling.n)
            deadline = _Deadline(self._config.request_timeout_s if work.timeout_s is None else work.timeout_s)
            if sampling.n == 1:
                completions = self._route(request_id, pod_request_id, prompt_ids, sampling, deadline, start, on_end)
            else:
                completions = fan_out.merge(lambda index: self._route(
                    request_id, f"{pod_request_id}-{index}", prompt_ids, fan_out.child_params(sampling, index),
                    deadline, start, on_end, index,
                ), sampling.n)
            async with aclosing(completions):
                async for chunk in completions:
                    num_output_tokens += len(chunk.token_ids)
                    yield chunk
            outcome = OK
        except RouteError as exc:
            outcome = outcome_of_code(exc.code)
            if exc.where is not None:
                logger.info("request %s ended with %s on %s: %s", request_id, exc.code.name, exc.where, exc.message)
            raise CallEnded(exc.code, exc.message, exc.trailing_metadata) from None
        except (asyncio.CancelledError, GeneratorExit):
            outcome = CANCELLED
            raise
        finally:
            if self._metrics is not None:
                self._metrics.requests.labels(outcome=outcome).inc()
                self._metrics.output_tokens.observe(num_output_tokens)

    def _count_invalid(self) -> None:
        """A Generate message that is unusable as it stands (counted as generate() counts bad input)."""
        if self._metrics is not None:
            self._metrics.requests.labels(outcome=INVALID).inc()

    async def _validate(self, work: GenerateInput) -> tuple[list[int], SamplingParams]:
        encode = self._codec.encode if self._codec is not None else None
        sampling = work.sampling
        try:
            prompt_ids = await prompt_token_ids(work, encode, no_tokenizer_hint="start the router with --tokenizer")
            if sampling.stop and self._codec is None:
                raise ValueError("sampling: stop strings need a tokenizer: start the router with --tokenizer")
        except ValueError as exc:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        capacity = min((c for c in (self._prefill.capacity, self._decode.capacity) if c is not None), default=None)
        if capacity is not None and sampling.n > capacity:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, f"n is {sampling.n}, and the pods of a tier run at "
                             f"most {capacity} requests at once, all together (--max-requests-in-flight)")
        # Refused here rather than shipped to a pod that would refuse it (a huge prompt costs every hop).
        # An unset max_tokens is the pods' to fill (the checkpoint's max_new_tokens fits the room left).
        named_max_tokens = None if "max_tokens" in sampling.unset else sampling.max_tokens
        max_model_len = self.max_model_len
        if max_model_len is not None and len(prompt_ids) + (named_max_tokens or 1) > max_model_len:
            error = prompt_too_long(len(prompt_ids), named_max_tokens, max_model_len)
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return prompt_ids, sampling

    @property
    def max_model_len(self) -> int | None:
        """The model length both tiers take, as their load reports say (None until they reported)."""
        lengths = [n for n in (self._prefill.max_model_len, self._decode.max_model_len) if n is not None]
        return min(lengths, default=None)

    async def _route(
        self, request_id, pod_request_id, prompt_ids, sampling, deadline, start, on_end: OnEnd, index=0
    ) -> AsyncIterator[GenerateChunk]:
        """One completion: prefill then decode (or decode alone); its chunks labelled with index."""
        prompt = PromptHashes(prompt_ids)
        generated: list[int] = []
        output = OutputText(self._codec.stream() if self._codec is not None else None, sampling)
        num_sent = 0

        def chunk(token_ids: list[int], finish: FinishReason | None, logprobs: list, prompt_logprobs: list):
            nonlocal num_sent
            delta = output.push(token_ids, finish)
            num_sent += len(delta.token_ids)
            return GenerateChunk(
                request_id=request_id,
                token_ids=delta.token_ids,
                text=delta.text,
                finish_reason=FinishReason.STOP if delta.stop_string is not None else finish,
                num_prompt_tokens=len(prompt_ids),
                num_output_tokens=num_sent,
                logprobs=logprobs[:len(delta.token_ids)],
                index=index,
                stop_string=delta.stop_string or "",
                prompt_logprobs=prompt_logprobs,
            )

        # Token 1 must not go out for a request no decode pod can take: check before any prefill.
        self._require_decode_capacity()
        hold = None
        try:
            if self._decide(prompt).route is Route.SPLIT:
                result, prefill_address = await self._run_prefill(pod_request_id, prompt, sampling, deadline)
                # Decode continues with the params prefill resolved (an older pod sends none: keep the request's).
                sampling = result.resolved_sampling or sampling
                generated.append(result.first_token_id)
                if result.finish_reason is None:
                    hold = _Hold(prefill_address, pod_request_id, result.handle)
                    # However the call ends (cancelled or timed out even while token 1 goes out), a
                    # hold no decode pod confirmed is released at once, not at the lease's end.
                    on_end(lambda hold=hold: self._abandon(hold))
                # Token 1 goes out before any decode work: TTFT never waits for the KV transfer.
                first_logprobs = [result.first_token_logprobs] if result.first_token_logprobs is not None else []
                first = chunk([result.first_token_id], result.finish_reason, first_logprobs, result.prompt_logprobs)
                yield first
                self._record_ttft(start)
                if first.finish_reason is not None:
                    return  # token 1 ended it (or a stop string in it): the finally frees any hold
            decoded_chunks = self._run_decode(pod_request_id, prompt, sampling, generated, deadline, hold)
            async with aclosing(decoded_chunks):
                async for decoded in decoded_chunks:
                    is_first = hold is None and len(generated) == len(decoded.token_ids) and bool(decoded.token_ids)
                    sent = chunk(decoded.token_ids, decoded.finish_reason, decoded.logprobs, decoded.prompt_logprobs)
                    yield sent
                    if is_first:
                        self._record_ttft(start)
                    if sent.finish_reason is not None:
                        # Maybe a stop string: closing the decode call aborts the request on the decode pod.
                        return
        finally:
            # No decode pod confirmed the pull: free the prefill hold now instead of at lease expiry.
            self._abandon(hold)

    def _require_decode_capacity(self) -> None:
        """RouteError unless some decode pod is healthy and not overloaded."""
        _, reason = candidates(self._decode.views())
        if reason is not None:
            raise self._no_pick_error(self._decode, reason, None, [])

    def _record_ttft(self, start: float) -> None:
        ttft = time.monotonic() - start
        trace.get_current_span().set_attribute("pdserve.ttft_s", ttft)
        if self._metrics is not None:
            self._metrics.ttft_seconds.observe(ttft)

    # ---- conditional disaggregation -----------------------------------------------------------
    def _decide(self, prompt: PromptHashes) -> RouteDecision:
        """Split, or decode-only when the decode pod this request would go to lacks little of the prompt
        (or prefill is saturated); recorded on the route span and in a metric."""
        rule = self._config.disaggregation
        num_uncached = prompt.num_tokens
        decision = RouteDecision(Route.SPLIT, RouteReason.PREFILL_NEEDED)
        with self._tracer.start_as_current_span("route decision") as span:
            if rule.max_local_prefill_tokens > 0 or rule.saturation_queue > 0:
                views = self._decode.views()
                cached = self._cached_tokens(views, prompt)
                choice = pick(self._config.policy, views, self._turns[self._decode.tier],
                              num_prompt_tokens=prompt.num_tokens, cached_tokens=cached,
                              weights=self._config.kv_weights)
                decode_view = next((v for v in views if v.address == choice.address), None)
                if decode_view is not None:
                    num_uncached = prompt.num_tokens - cached.get(decode_view.address, 0)
                decision = decide_route(num_uncached, self._prefill.views(), decode_view, rule)
            span.set_attribute("pdserve.route", decision.route.value)
            span.set_attribute("pdserve.route.reason", decision.reason.value)
            span.set_attribute("pdserve.route.num_uncached_tokens", num_uncached)
        server_span = trace.get_current_span()
        server_span.set_attribute("pdserve.route", decision.route.value)
        server_span.set_attribute("pdserve.route.reason", decision.reason.value)
        if self._metrics is not None:
            self._metrics.route_decisions.labels(route=decision.route.value, reason=decision.reason.value).inc()
        return decision

    def _cached_tokens(self, views, prompt: PromptHashes) -> dict[str, int]:
        if self._kv_index is None:
            return {}
        return self._kv_index.cached_tokens_by_pod((v.address for v in views if v.is_healthy), prompt)

    # ---- picking ------------------------------------------------------------------------------
    def _pick(self, pool: WorkerPool, exclude: list[str], prompt: PromptHashes):
        turn = self._turns[pool.tier]
        self._turns[pool.tier] = turn + 1
        with self._tracer.start_as_current_span(f"route {pool.tier}") as span:
            views = pool.views()
            cached = self._cached_tokens(views, prompt) if self._config.policy == "kv-aware" else {}
            choice = pick(self._config.policy, views, turn, exclude, num_prompt_tokens=prompt.num_tokens,
                          cached_tokens=cached, weights=self._config.kv_weights)
            span.set_attribute("pdserve.policy", self._config.policy)
            span.set_attribute("pdserve.worker", choice.address or "")
            if choice.address is not None and cached:
                span.set_attribute("pdserve.kv.cached_tokens", cached.get(choice.address, 0))
            span.set_attribute("pdserve.excluded", list(exclude))
            if choice.reason is not None:
                span.set_attribute("pdserve.no_pick", choice.reason.value)
        return choice

    @staticmethod
    def _no_pick_error(pool: WorkerPool, reason: NoPick | None, last_error, tried: list[str]) -> RouteError:
        where = ", ".join(tried) or None
        attempts = f"{pool.tier} failed on {len(tried)} worker{'s' if len(tried) != 1 else ''}"
        if isinstance(last_error, Stalled):
            return RouteError(grpc.StatusCode.UNAVAILABLE, f"{attempts}: {last_error}", where)
        if last_error is not None:
            hint_s = retry_after_s(last_error) if last_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            return RouteError(last_error.code(), f"{attempts}: {last_error.details()}", where, hint_s)
        if reason is NoPick.ALL_OVERLOADED:
            return RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"every {pool.tier} worker is overloaded",
                              retry_after_s=pool.retry_after_s())
        return RouteError(
            grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.tier} worker ({len(pool.addresses)} known)",
            ", ".join(pool.addresses) or None,
        )

    # ---- prefill ------------------------------------------------------------------------------
    async def _run_prefill(self, request_id, prompt: PromptHashes, sampling, deadline):
        tried: list[str] = []
        last_error = None
        reason = None
        for _ in range(1 + self._config.max_prefill_retries):
            choice = self._pick(self._prefill, tried, prompt)
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
                if exc.code() not in _RETRYABLE:
                    raise RouteError(exc.code(), exc.details(), choice.address) from None
                if exc.code() in _DROPPED:
                    self._prefill.mark_unavailable(choice.address)
                else:
                    self._prefill.mark_overloaded(choice.address, retry_after_s(exc))
                last_error = exc
                cause = str(exc.code())
            self._count_retry("prefill")
            logger.warning("request %s: prefill on %s failed (%s), retrying", request_id, choice.address, cause)
        raise self._no_pick_error(self._prefill, reason, last_error, tried)

    async def _call_prefill(self, address, request_id, prompt_ids, sampling, deadline):
        """One Prefill call; Stalled when it has no answer after stall_timeout_s and the pod fails its
        health probes too (frozen: a pod busy computing a long queue still answers them, and one slow
        probe alone does not give up a call about to be answered)."""
        stalled_at = time.monotonic() + self._config.stall_timeout_s
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
                self._abandon(_Hold(address, request_id, result.handle))
            return
        error = None if call.cancelled() else call.exception()
        if error is None or (isinstance(error, grpc.aio.AioRpcError) and error.code() in _ANSWER_MAY_BE_LOST):
            # The pod may have answered, and made its hold, just as the call ended here: the answer is
            # lost, but the request id still names the hold.
            self._spawn(self._release(address, request_id))

    # ---- decode -------------------------------------------------------------------------------
    async def _run_decode(
        self, request_id, prompt: PromptHashes, sampling, generated, deadline, hold: "_Hold | None"
    ):
        """Yields DecodeChunks with tokens or a finish reason. `generated` (token 1 first, or empty without a
        prefill) grows as tokens are yielded, so a re-issue after a failure carries exactly what the
        client already has. Without a hold the decode pod computes the prompt itself (and its prompt
        logprobs, until the client has the first token). A pod that refuses (overloaded) is tried again
        after a backoff; one that fails or freezes is not."""
        # Pods that failed or froze on this request: marked unavailable, so not picked again until a
        # health probe finds them serving (a false stall, e.g. while the router itself was starved).
        failed: list[str] = []
        refused: list[str] = []  # overloaded since the last backoff
        backoff = Backoff(self._config.decode_admit_timeout_s)
        last_error = None
        while True:
            if "max_tokens" not in sampling.unset and len(generated) >= sampling.max_tokens:
                # A pod died right after the last token but before saying so: the request is complete.
                yield wire.DecodeChunk(finish_reason=FinishReason.LENGTH)
                return
            choice = self._pick(self._decode, refused, prompt)
            if choice.address is None:
                if not backoff.can_wait(deadline):
                    raise self._no_pick_error(self._decode, choice.reason, last_error, failed + refused)
                await backoff.wait(deadline)
                refused.clear()
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
                        backoff.reset()
                        yield decoded
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    hint_s = retry_after_s(exc)
                    self._decode.mark_overloaded(choice.address, hint_s)
                    refused.append(choice.address)
                    backoff.hint(hint_s)
                    last_error = exc
                    continue
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED and carries_handle:
                    # The handle came from this deployment's own prefill pod: the pods' KV handle keys
                    # differ. The tokens so far are good; the decode pod recomputes the prompt instead.
                    logger.error("request %s: decode pod %s refused the KV handle of prefill pod %s (%s): the "
                                 "pods' --kv-handle-key-file / PDSERVE_KV_HANDLE_KEY differ; recomputing",
                                 request_id, choice.address, hold.prefill_address, exc.details())
                    self._abandon(hold)
                    self._count_retry("decode")
                    last_error = exc
                    continue
                if exc.code() not in _DROPPED:
                    raise RouteError(exc.code(), exc.details(), choice.address) from None
                last_error = exc
                reason = str(exc.code())
            except Stalled as exc:
                last_error = exc
                reason = str(exc)
            # The pod died or froze, maybe mid-pull: never hand the same KV to another pod; recompute.
            self._decode.mark_unavailable(choice.address)
            self._abandon(hold)
            failed.append(choice.address)
            self._count_retry("decode")
            if len(failed) > self._config.max_decode_retries:
                raise self._no_pick_error(self._decode, None, last_error, failed)
            logger.warning(
                "request %s: decode on %s failed (%s) after %d tokens, re-issuing",
                request_id, choice.address, reason, len(generated),
            )

    async def _decode_on(self, address: str, work: wire.DecodeInput, generated: list[int], deadline, hold):
        """One Decode call: yields its chunks with tokens or a finish reason, until the finish reason."""
        with self._decode.use(address) as stub:
            call = stub.Decode(convert.decode_request_to_proto(work), timeout=deadline.remaining())
            finished = False
            try:
                is_first = True
                while True:
                    response = await self._next_message(call, address, deadline, is_first)
                    if response is grpc.aio.EOF:
                        break
                    decoded = self._decode_chunk(address, response)
                    if is_first:
                        is_first = False
                        # The first message comes after the pull was confirmed (or given up).
                        if decoded.kv_pull is not None and decoded.kv_pull.outcome in _HOLD_UNUSED:
                            # The pod recomputed: it may not reach the prefill pod to end the hold itself.
                            self._abandon(hold)
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
                    self._spawn(_await_status(call, self._config.stall_timeout_s))
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
            return convert.decode_chunk_from_proto(response)
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

    def _count_retry(self, tier: str) -> None:
        if self._metrics is not None:
            self._metrics.retries.labels(tier=tier).inc()

    # ---- KV-hold cleanup ----------------------------------------------------------------------
    def _spawn(self, coroutine) -> None:
        # Runs even when the request's task is being cancelled; a reference keeps it from being collected.
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abandon(self, hold: "_Hold | None") -> None:
        """Gives up the hold (once): later decode attempts recompute, and the prefill pod frees the blocks."""
        if hold is None or hold.is_settled:
            return
        hold.is_settled = True
        self._spawn(self._release(hold.prefill_address, hold.request_id, hold.handle.engine_id))

    async def _release(self, address: str, request_id: str, engine_id: str = "") -> None:
        """Ends the request's hold on the prefill pod at address; engine_id "": whichever engine it runs now."""
        try:
            with self._prefill.use(address) as client:
                await client.release_kv(request_id, engine_id)
        except (grpc.aio.AioRpcError, LookupError) as exc:
            # The lease expiry frees the blocks anyway; this only makes it sooner.
            logger.info("request %s: releasing the KV hold on %s failed: %s", request_id, address, exc)

    async def drain(self) -> None:
        """Waits for pending hold releases (called at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
