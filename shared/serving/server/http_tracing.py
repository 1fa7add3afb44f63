"""Tracing of the HTTP front: an ASGI middleware that opens each request's SERVER span, continuing a
client's `traceparent`."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.serving.server.grpc_tracing import _METADATA_GETTER, _detach


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

