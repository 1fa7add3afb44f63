"""OpenTelemetry tracing for pdserve services: configuration (flags + OTEL_* values handed in by
__main__), a service-owned tracer provider with OTLP/gRPC export, and the span helpers. The W3C context
travels in gRPC metadata (grpc_tracing.py's interceptors) and HTTP headers (http_tracing.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.serving.server.grpc_tracing import (  # noqa: F401 (DEFAULT_UNTRACED_METHOD_PREFIXES: for callers)
    DEFAULT_UNTRACED_METHOD_PREFIXES, _METADATA_SETTER, TracingServerInterceptor, TracingUnaryStreamClientInterceptor,
    TracingUnaryUnaryClientInterceptor,
)

logger = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "pdserve"
_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})


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
