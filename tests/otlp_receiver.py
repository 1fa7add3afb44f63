"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService on a grpcio server
bound to 127.0.0.1 on a free port, collecting exported spans thread-safely."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

_KIND_NAMES = {
    trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED",
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
_STATUS_NAMES = {
    trace_pb2.Status.STATUS_CODE_UNSET: "UNSET",
    trace_pb2.Status.STATUS_CODE_OK: "OK",
    trace_pb2.Status.STATUS_CODE_ERROR: "ERROR",
}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids as lowercase hex; parent_span_id is None for a root span."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    service_name: str | None
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "UNSET"
    start_time_ns: int = 0
    end_time_ns: int = 0


def _any_value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in key_values}


def _convert(span: trace_pb2.Span, service_name: str | None) -> ReceivedSpan:
    return ReceivedSpan(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex() or None,
        name=span.name,
        kind=_KIND_NAMES.get(span.kind, str(span.kind)),
        service_name=service_name,
        attributes=_attributes(span.attributes),
        status=_STATUS_NAMES.get(span.status.code, str(span.status.code)),
        start_time_ns=span.start_time_unix_nano,
        end_time_ns=span.end_time_unix_nano,
    )


class _TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.num_exports = 0

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            service_name = _attributes(resource_spans.resource.attributes).get("service.name")
            for scope_spans in resource_spans.scope_spans:
                received.extend(_convert(span, service_name) for span in scope_spans.spans)
        with self._lock:
            self._spans.extend(received)
            self.num_exports += 1
            self._lock.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(list(self._spans)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True


class OtlpReceiver:
    """Start with `with OtlpReceiver() as receiver:`; point exporters at `receiver.endpoint`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._collector = _TraceCollector()
        self._server: grpc.Server | None = None
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("OtlpReceiver is not started")
        return f"http://{self._host}:{self.port}"

    def start(self) -> "OtlpReceiver":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, server)
        self.port = server.add_insecure_port(f"{self._host}:0")
        server.start()
        self._server = server
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    @property
    def num_exports(self) -> int:
        return self._collector.num_exports

    def spans(self) -> list[ReceivedSpan]:
        return self._collector.snapshot()

    def spans_by_trace(self) -> dict[str, list[ReceivedSpan]]:
        """Spans grouped by trace id, each group in start-time order."""
        grouped: dict[str, list[ReceivedSpan]] = {}
        for span in self._collector.snapshot():
            grouped.setdefault(span.trace_id, []).append(span)
        for group in grouped.values():
            group.sort(key=lambda span: span.start_time_ns)
        return grouped

    def clear(self) -> None:
        self._collector.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float) -> bool:
        """Block until predicate(all spans so far) is true; False if `timeout` s pass first."""
        return self._collector.wait_for(predicate, timeout)

    def wait_for_spans(self, count: int, timeout: float) -> list[ReceivedSpan]:
        self.wait_for(lambda spans: len(spans) >= count, timeout)
        return self.spans()


def children_of(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [span for span in spans if span.parent_span_id == parent.span_id]
