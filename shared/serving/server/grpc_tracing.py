"""Tracing of gRPC calls: the W3C context carried in call metadata, the server interceptor that opens each
call's SERVER span, and the client interceptors that open CLIENT spans and inject the context."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

# Probes hit these every few seconds; tracing them would bury the request traces.
# The KV event stream lives as long as its router: a span for it would never end.
DEFAULT_UNTRACED_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/pdserve.v1.KvEventService/")
# OpenTelemetry semantic conventions: these codes mark a SERVER span as failed; a client error
# (bad argument, not found, cancelled by the caller, ...) is not a server fault.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

# ---------------------------------------------------------------- metadata carriers


class _MetadataGetter(Getter):
    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key.lower())
        return [value] if value is not None else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


class _MetadataSetter(Setter):
    def set(self, carrier: list, key: str, value: str) -> None:
        carrier.append((key.lower(), value))


_METADATA_GETTER = _MetadataGetter()
_METADATA_SETTER = _MetadataSetter()


def _metadata_dict(metadata: Iterable[Any] | None) -> dict[str, str]:
    result: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        # Binary (-bin) metadata values are bytes and never carry trace context.
        if isinstance(value, str):
            result.setdefault(key.lower(), value)
    return result


def _rpc_attributes(full_method: str) -> dict[str, str]:
    service, _, method = full_method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _span_name(full_method: str) -> str:
    return full_method.lstrip("/")


# ---------------------------------------------------------------- server side


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace (W3C traceparent in metadata) with one SERVER span per RPC.
    The span is current while the handler runs and, for streamed responses, lasts until the
    stream ends."""

    def __init__(
        self,
        tracer: trace.Tracer,
        propagator: TraceContextTextMapPropagator,
        untraced_method_prefixes: Sequence[str] = DEFAULT_UNTRACED_METHOD_PREFIXES,
    ) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._untraced = tuple(untraced_method_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if handler is None or method.startswith(self._untraced):
            return handler
        parent = self._propagator.extract(
            _metadata_dict(handler_call_details.invocation_metadata), getter=_METADATA_GETTER
        )
        start = _SpanStarter(self._tracer, method, parent)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_behavior(handler.unary_unary, start))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_behavior(handler.unary_stream, start))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_behavior(handler.stream_unary, start))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_wrap_behavior(handler.stream_stream, start))
        return handler


@dataclass(frozen=True)
class _SpanStarter:
    tracer: trace.Tracer
    method: str
    parent: otel_context.Context

    def start(self) -> trace.Span:
        return self.tracer.start_span(
            _span_name(self.method),
            context=self.parent,
            kind=SpanKind.SERVER,
            attributes=_rpc_attributes(self.method),
        )


def _wrap_behavior(behavior: Callable, starter: _SpanStarter) -> Callable:
    # aio handlers are coroutines (unary response, or context.write() streaming) or async
    # generators (streaming response); the span must wrap the whole of either.
    if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
        return behavior  # a sync handler runs in an executor thread: left untraced
    if inspect.isasyncgenfunction(behavior):

        async def traced_stream(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
            with _server_span(starter, context):
                async for response in behavior(request_or_iterator, context):
                    yield response

        return traced_stream

    async def traced_call(request_or_iterator: Any, context: Any) -> Any:
        with _server_span(starter, context):
            return await behavior(request_or_iterator, context)

    return traced_call


@contextlib.contextmanager
def _server_span(starter: _SpanStarter, context: Any) -> Iterator[None]:
    """The call's span, current for the call's whole length, ended with the call's status."""
    span = starter.start()
    token = otel_context.attach(trace.set_span_in_context(span))
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        _end_server_span(span, context, error)
        _detach(token)


def _detach(token: object) -> None:
    try:
        otel_context.detach(token)
    except Exception:  # a stream closed from another context; the span is already ended
        logger.debug("tracing: context detach from a different context", exc_info=True)


def _end_server_span(span: trace.Span, context: Any, error: BaseException | None) -> None:
    code = _server_code(context, error)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, _details(context) or code.name))
    if error is not None and not isinstance(error, (grpc.aio.AbortError, asyncio.CancelledError)):
        span.record_exception(error)
    span.end()


def _server_code(context: Any, error: BaseException | None) -> grpc.StatusCode:
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    code = _context_code(context)
    if code is not None:
        return code
    if error is None:
        return grpc.StatusCode.OK
    # An abort always sets the context's code; anything else escaping becomes UNKNOWN in grpc.
    return grpc.StatusCode.UNKNOWN


def _context_code(context: Any) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:
        return None
    if isinstance(code, grpc.StatusCode):
        return code
    return _code_from_int(code)


def _details(context: Any) -> str | None:
    try:
        return context.details() or None
    except Exception:
        return None


def _code_from_int(value: Any) -> grpc.StatusCode | None:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return None


# ---------------------------------------------------------------- client side


class _ClientTracing:
    def __init__(self, tracer: trace.Tracer, propagator: TraceContextTextMapPropagator) -> None:
        self._tracer = tracer
        self._propagator = propagator

    def _start(
        self, details: grpc.aio.ClientCallDetails
    ) -> tuple[trace.Span, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        # The caller's current span (if any) is the parent: interceptors run in a task copied
        # from the caller's context at call time.
        span = self._tracer.start_span(
            _span_name(method), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method)
        )
        # This CLIENT span is the parent the server must see, replacing any context already there.
        carrier = [
            (item[0], item[1])
            for item in (details.metadata or ())
            if item[0] not in self._propagator.fields
        ]
        self._propagator.inject(
            carrier, context=trace.set_span_in_context(span), setter=_METADATA_SETTER
        )
        new_details = grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=grpc.aio.Metadata(*carrier),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )
        return span, new_details

    @staticmethod
    def _end_when_done(span: trace.Span, call: Any) -> None:
        def on_done(finished_call: Any) -> None:
            _end_client_span(span, _finished_call_code(finished_call))

        try:
            call.add_done_callback(on_done)
        except NotImplementedError:  # an inner interceptor already produced the response
            _end_client_span(span, grpc.StatusCode.OK)

    async def _traced_call(self, continuation: Callable, client_call_details, request: Any) -> Any:
        """Start the CLIENT span, make the call with the span's traceparent, end the span with the call."""
        span, details = self._start(client_call_details)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            span.record_exception(exc)
            _end_client_span(span, grpc.StatusCode.UNKNOWN)
            raise
        self._end_when_done(span, call)
        return call


def _finished_call_code(call: Any) -> grpc.StatusCode | None:
    """Status of a call that has terminated, read without an event-loop turn (done callbacks
    are synchronous; a finished call's status is already there)."""
    if call.cancelled():
        return grpc.StatusCode.CANCELLED
    coroutine = call.code()
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    except Exception:
        logger.debug("tracing: could not read a finished call's status", exc_info=True)
        return None
    coroutine.close()
    return None


def _end_client_span(span: trace.Span, code: grpc.StatusCode | None) -> None:
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class TracingUnaryUnaryClientInterceptor(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    """A CLIENT span per unary call; its traceparent goes out in the call's metadata."""

    async def intercept_unary_unary(
        self, continuation: Callable, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._traced_call(continuation, client_call_details, request)


class TracingUnaryStreamClientInterceptor(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    """A CLIENT span per server-streaming call, ended when the stream terminates (completed,
    failed, cancelled or abandoned), whether the caller iterates it or calls read()."""

    async def intercept_unary_stream(
        self, continuation: Callable, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._traced_call(continuation, client_call_details, request)
