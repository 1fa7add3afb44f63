"""One pod call's lifecycle, written once for Prefill, Decode and the colocated Generate: submit to
the engine, TTFT and TPOT, the outcome label, the status a named error ends the call with, and the
abort of a request the call leaves unfinished."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from shared.engine.request import FinishReason, Request
from shared.serving.pod.engine_thread import RequestStream
from shared.serving.generation import CallEnded
from shared.serving.pod.outcomes import (
    CANCELLED, ERROR, OK, RETRY_AFTER_KEY, CallError, PodOverloaded, outcome_of_code, status_of,
)
from shared.serving.server.telemetry import SpanAttr

if TYPE_CHECKING:
    from shared.serving.pod.servicer import PodServicer

logger = logging.getLogger(__name__)


class PodCall:
    """Use as `async with`: the body raises a CallError (or lets one through) to end the call with
    its status; anything else unexpected is logged and ends it with INTERNAL."""

    def __init__(self, servicer: "PodServicer", context: grpc.aio.ServicerContext | None, tier: str | None):
        """context: the gRPC call's (None: work called in process, whose failures raise CallEnded); tier:
        name of the queue/compute spans recorded from the stream's timeline (None: the servicer records its
        own spans)."""
        self.pod = servicer.pod
        self.context = context
        self._servicer = servicer
        self._tier = tier
        self.span = trace.get_current_span()
        self.parent = servicer.trace_parent()
        self.started = time.monotonic()
        self.stream: RequestStream | None = None
        self.request_id: str | None = None  # the id on the call's spans (default: the engine request's)
        self.num_output_tokens = 0
        self.first_token_at: float | None = None
        self._outcome: str | None = None  # settled before the last message goes out
        self._is_finished = False

    def submit(self, request: Request) -> RequestStream:
        self.stream = self.pod.submit(request)
        return self.stream

    def count_tokens(self, num_tokens: int) -> None:
        """Tokens about to be sent; the first ones mark the TTFT (histogram and span attribute)."""
        if num_tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            ttft_s = self.first_token_at - self.started
            self._servicer.metrics.ttft_seconds.observe(ttft_s)
            self.span.set_attribute(SpanAttr.TTFT_S, ttft_s)
        self.num_output_tokens += num_tokens

    def finish(self, reason: FinishReason) -> None:
        """The request finished. Settled before the last message goes out: a caller may hang up once
        it has it, and that is no cancellation."""
        self._is_finished = True
        self._outcome = ERROR if reason is FinishReason.ERROR else OK
        self.span.set_attribute(SpanAttr.NUM_OUTPUT_TOKENS, self.num_output_tokens)
        self.span.set_attribute(SpanAttr.FINISH_REASON, reason.value)
        if self.num_output_tokens > 1 and self.first_token_at is not None:
            tpot_s = (time.monotonic() - self.first_token_at) / (self.num_output_tokens - 1)
            self._servicer.metrics.tpot_seconds.observe(tpot_s)
            self.span.set_attribute(SpanAttr.TPOT_S, tpot_s)

    def stop_early(self, reason: FinishReason) -> None:
        """The request ended before the engine finished it (a stop string): the engine drops it now,
        freeing its blocks, and the call counts as finished."""
        self.finish(reason)
        if self.stream is not None:
            self.pod.loop.abort(self.stream.request_id)

    def engine_request_finished(self) -> None:
        """The engine is done with the request (nothing to abort) although the call goes on."""
        self._is_finished = True

    async def __aenter__(self) -> "PodCall":
        return self

    async def __aexit__(self, exc_type, exc: BaseException | None, tb: Any) -> bool:
        status = None
        if exc is None:
            outcome = self._outcome or OK
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            outcome = self._outcome or CANCELLED  # the caller went away
        elif isinstance(exc, grpc.aio.AbortError):
            outcome = self._outcome or ERROR  # the status was already sent
        elif isinstance(exc, CallEnded):
            outcome = self._outcome or outcome_of_code(exc.code)
        elif isinstance(exc, CallError):
            status = status_of(exc)
            outcome = status[1]
        else:
            logger.error("call failed unexpectedly", exc_info=(exc_type, exc, tb))
            status, outcome = (grpc.StatusCode.INTERNAL, ERROR), ERROR
            exc = RuntimeError(f"internal error: {exc!r}")
        self._end(outcome)
        if status is not None:
            if self.context is None:
                raise CallEnded(status[0], str(exc), _retry_hint(exc)) from None
            await self.context.abort(status[0], str(exc), trailing_metadata=_retry_hint(exc))
        return False

    def _end(self, outcome: str) -> None:
        if self.stream is not None:
            if not self._is_finished and not self.stream.refused:
                # Cancelled, deadline or error: the engine frees the request's blocks (after any READ in flight).
                self.pod.loop.abort(self.stream.request_id)
            if self._tier is not None:
                request_id = self.request_id or self.stream.request_id
                self._servicer.record_stage_spans(
                    self._tier, self.parent, self.stream.timeline, {SpanAttr.REQUEST_ID: request_id}
                )
        self._servicer.metrics.record_outcome(outcome)


async def refuse(servicer: "PodServicer", context: grpc.aio.ServicerContext, error: CallError) -> None:
    """End a call that started no work with the error's status (and retry hint), counted by its outcome."""
    code, outcome = status_of(error)
    servicer.metrics.record_outcome(outcome)
    await context.abort(code, str(error), trailing_metadata=_retry_hint(error))


def call_ended(error: CallError) -> CallEnded:
    """A named error as the status of the in-process call it ends."""
    return CallEnded(status_of(error)[0], str(error), _retry_hint(error))


def _retry_hint(error: BaseException) -> tuple[tuple[str, str], ...]:
    if isinstance(error, PodOverloaded) and error.retry_after_ms is not None:
        return ((RETRY_AFTER_KEY, str(error.retry_after_ms)),)
    return ()
