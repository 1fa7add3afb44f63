"""OpenTelemetry tracing for pdserve services: configuration (flags + OTEL_* values handed in by
__main__), a service-owned tracer provider with OTLP/gRPC export, and W3C trace context carried in
gRPC metadata by a grpc.aio server interceptor and client interceptors, and in HTTP headers by an ASGI
middleware for the OpenAI-compatible front."""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "pdserve"
# Probes hit these every few seconds; tracing them would bury the request traces.
# The KV event stream lives as long as its router: a span for it would never end.
DEFAULT_UNTRACED_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/pdserve.v1.KvEventService/")
_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
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


class SpanAttr:
    """Attribute names every pdserve span uses for the same fact (one word per concept)."""

    REQUEST_ID = "pdserve.request_id"
    TTFT_S = "pdserve.ttft_s"
    TPOT_S = "pdserve.tpot_s"
    NUM_PROMPT_TOKENS = "pdserve.num_prompt_tokens"
    NUM_OUTPUT_TOKENS = "pdserve.num_output_tokens"
    FINISH_REASON = "pdserve.finish_reason"
    KV_BYTES = "pdserve.kv.bytes"
    KV_BLOCKS = "pdserve.kv.num_blocks"
    KV_GBPS = "pdserve.kv.gb_per_s"
    KV_OUTCOME = "pdserve.kv.outcome"
    KV_TRANSPORT = "pdserve.kv.transport"  # the UCX transport of a pull (tcp, rdma, cma, cuda_ipc)
    KV_ENGINE_ID = "pdserve.kv.engine_id"


@dataclass(frozen=True)
class TracingConfig:
    """What a service needs to trace. `otlp_endpoint=None` turns tracing off (cheap no-op)."""

    service_name: str
    otlp_endpoint: str | None = None
    sampling_ratio: float = 1.0
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    export_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name must be a non-empty string")
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise ValueError(f"sampling_ratio must be in [0, 1], got {self.sampling_ratio}")
        if self.export_timeout_s <= 0:
            raise ValueError(f"export_timeout_s must be > 0, got {self.export_timeout_s}")
        if self.otlp_endpoint is not None:
            _check_endpoint(self.otlp_endpoint)

    @property
    def is_enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @classmethod
    def from_flags_and_env(
        cls,
        env: Mapping[str, str],
        *,
        default_service_name: str,
        otlp_endpoint: str | None = None,
        sampling_ratio: float | None = None,
    ) -> "TracingConfig":
        """Flags win over the standard OTEL_* variables in `env`, which win over defaults.

        Reads OTEL_SDK_DISABLED, OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
        OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER(+_ARG) and OTEL_RESOURCE_ATTRIBUTES.
        """
        service_name = env.get("OTEL_SERVICE_NAME") or default_service_name
        resource_attributes = _parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE_WORDS:
            return cls(service_name=service_name, resource_attributes=resource_attributes)
        endpoint = (
            otlp_endpoint
            or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or None
        )
        ratio = sampling_ratio if sampling_ratio is not None else _ratio_from_env(env)
        return cls(
            service_name=service_name,
            otlp_endpoint=endpoint,
            sampling_ratio=ratio,
            resource_attributes=resource_attributes,
        )


def _check_endpoint(endpoint: str) -> None:
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(
            f"otlp endpoint must look like http://host:4317 (OTLP over gRPC), got {endpoint!r}"
        )


def _ratio_from_env(env: Mapping[str, str]) -> float:
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        raw = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number, got {raw!r}") from None
    return 1.0


def _parse_resource_attributes(raw: str) -> dict[str, str]:
    attributes = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTEL_RESOURCE_ATTRIBUTES item must be key=value, got {item!r}")
        attributes[key.strip()] = value.strip()
    return attributes


class Tracing:
    """A service's tracing: owns its tracer provider (never the global one) and flushes it at
    shutdown. Disabled tracing hands out a no-op tracer and no interceptors."""

    def __init__(self, config: TracingConfig, provider: Any | None) -> None:
        self.config = config
        self.provider = provider
        self.tracer: trace.Tracer = (
            provider.get_tracer(INSTRUMENTATION_NAME) if provider else trace.NoOpTracer()
        )
        self.propagator = TraceContextTextMapPropagator()

    @property
    def is_enabled(self) -> bool:
        return self.provider is not None

    def server_interceptors(
        self, untraced_method_prefixes: Sequence[str] = DEFAULT_UNTRACED_METHOD_PREFIXES
    ) -> list[grpc.aio.ServerInterceptor]:
        """Pass to grpc.aio.server(interceptors=...). Empty when tracing is off."""
        if not self.is_enabled:
            return []
        return [TracingServerInterceptor(self.tracer, self.propagator, untraced_method_prefixes)]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Pass to grpc.aio.insecure_channel(..., interceptors=...). Empty when tracing is off."""
        if not self.is_enabled:
            return []
        return [
            TracingUnaryUnaryClientInterceptor(self.tracer, self.propagator),
            TracingUnaryStreamClientInterceptor(self.tracer, self.propagator),
        ]

    def inject(
        self, metadata: Iterable[tuple[str, str]] = (), ctx: otel_context.Context | None = None
    ) -> list[tuple[str, str]]:
        """Metadata plus the traceparent of `ctx` (default: the current context), for calls made
        without the client interceptors."""
        carrier = list(metadata)
        if self.is_enabled:
            self.propagator.inject(carrier, context=ctx, setter=_METADATA_SETTER)
        return carrier

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is buffered, then stop the exporter. Safe to call twice."""
        if self.provider is None:
            return
        provider, self.provider = self.provider, None
        self.tracer = trace.NoOpTracer()
        if not provider.force_flush(int(timeout_s * 1000)):
            logger.warning("tracing: spans still unexported after %.1fs at shutdown", timeout_s)
        provider.shutdown()


def setup_tracing(config: TracingConfig) -> Tracing:
    """Build the service's Tracing. Imports the SDK only when tracing is on."""
    if not config.is_enabled:
        return Tracing(config, None)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = config.otlp_endpoint
    scheme = urlsplit(endpoint).scheme if "://" in endpoint else "http"
    exporter = OTLPSpanExporter(
        endpoint=endpoint, insecure=(scheme == "http"), timeout=config.export_timeout_s
    )
    resource = Resource({**config.resource_attributes, "service.name": config.service_name})
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(config.sampling_ratio)),
        resource=resource,
        # The service flushes at its own shutdown; no atexit hook behind its back.
        shutdown_on_exit=False,
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(config, provider)


def record_span(
    tracer: trace.Tracer,
    name: str,
    parent: otel_context.Context | None,
    start_time_ns: int,
    end_time_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Record a finished span whose times were measured elsewhere (e.g. by the engine loop: queue
    wait, compute, KV hold). Times are time.time_ns() values; `parent` is the context captured
    with otel_context.get_current() in the RPC handler (None: the current context)."""
    if end_time_ns < start_time_ns:
        raise ValueError(f"span {name!r} ends ({end_time_ns}) before it starts ({start_time_ns})")
    span = tracer.start_span(name, context=parent, start_time=start_time_ns, attributes=attributes)
    span.end(end_time=end_time_ns)


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
            span = starter.start()
            token = otel_context.attach(trace.set_span_in_context(span))
            error: BaseException | None = None
            try:
                async for response in behavior(request_or_iterator, context):
                    yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                _end_server_span(span, context, error)
                _detach(token)

        return traced_stream

    async def traced_call(request_or_iterator: Any, context: Any) -> Any:
        span = starter.start()
        token = otel_context.attach(trace.set_span_in_context(span))
        error: BaseException | None = None
        try:
            return await behavior(request_or_iterator, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end_server_span(span, context, error)
            _detach(token)

    return traced_call


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


# ---------------------------------------------------------------- HTTP server side


class HttpTracingMiddleware:
    """ASGI middleware: one SERVER span per request to a traced path (OpenTelemetry's HTTP conventions:
    named `METHOD route`), continuing the caller's trace from a W3C `traceparent` header. The span is
    current while the app runs, streamed body included, so calls made for the request are its children."""

    def __init__(self, app: Any, tracer: Callable[[], trace.Tracer], traced_paths: Sequence[str]) -> None:
        """tracer: called per request (the service may set its tracing up after building the app)."""
        self._app = app
        self._tracer = tracer
        self._paths = frozenset(traced_paths)
        self._propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        parent = self._propagator.extract(headers, getter=_METADATA_GETTER)
        method, route = scope["method"], scope["path"]
        span = self._tracer().start_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route, "url.path": route,
                        "url.scheme": scope.get("scheme", "http")},
        )

        async def traced_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # as for gRPC: a client's mistake is no server fault
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            await self._app(scope, receive, traced_send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()
            _detach(token)


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
