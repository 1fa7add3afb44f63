"""Tracing across a real gRPC hop (two aio servers chained A -> B, exported to a real OTLP
receiver) and Prometheus metrics scraped over HTTP."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import grpc
import pytest
from opentelemetry import context as otel_context
from prometheus_client.parser import text_string_to_metric_families

from shared.serving.server.metrics import OUTCOMES, ServiceMetrics, start_metrics_server
from shared.serving.server.telemetry import SpanAttr, Tracing, TracingConfig, record_span, setup_tracing
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, children_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def _traceparent(sampled: bool = True) -> str:
    return f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-{'01' if sampled else '00'}"


# ------------------------------------------------------------------ two small services


def _service_b(tracing: Tracing) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
        request_id = dict(context.invocation_metadata()).get("x-request-id", "")
        return b"b:" + request + request_id.encode()

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        # Engine-style span: timed on another thread, parented by the captured handler context.
        parent = otel_context.get_current()
        start_ns = time.time_ns()
        await asyncio.to_thread(
            lambda: record_span(tracing.tracer, "b.queue", parent, start_ns, time.time_ns(),
                                {SpanAttr.REQUEST_ID: "r1"})
        )
        # A span opened by the handler must nest under the SERVER span across yields.
        with tracing.tracer.start_as_current_span("b.work"):
            for index in range(3):
                await asyncio.sleep(0.01)
                yield b"%s-%d" % (request, index)

    async def written_stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for index in range(2):
            await context.write(b"w%d" % index)
            await asyncio.sleep(0.01)

    async def endless(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        while True:
            yield b"tick"
            await asyncio.sleep(0.01)

    return grpc.method_handlers_generic_handler(
        "test.B",
        {
            "Endless": grpc.unary_stream_rpc_method_handler(endless),
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "WrittenStream": grpc.unary_stream_rpc_method_handler(written_stream),
        },
    )


def _service_a(channel_to_b: grpc.aio.Channel) -> grpc.GenericRpcHandler:
    b_unary = channel_to_b.unary_unary("/test.B/Unary")
    b_stream = channel_to_b.unary_stream("/test.B/Stream")
    b_written = channel_to_b.unary_stream("/test.B/WrittenStream")
    b_endless = channel_to_b.unary_stream("/test.B/Endless")

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield await b_unary(request, metadata=(("x-request-id", "+r1"),))
        async for item in b_stream(request):
            yield item
        call = b_written(request)
        while (item := await call.read()) is not grpc.aio.EOF:
            yield item

    async def relay_bad(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            await b_unary(b"bad")
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details())
        return b"unreachable"

    async def relay_endless(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for item in b_endless(request):
            yield item

    return grpc.method_handlers_generic_handler(
        "test.A",
        {
            "RelayEndless": grpc.unary_stream_rpc_method_handler(relay_endless),
            "Relay": grpc.unary_stream_rpc_method_handler(relay),
            "RelayBad": grpc.unary_unary_rpc_method_handler(relay_bad),
        },
    )


@asynccontextmanager
async def _chain(endpoint: str | None, sampling_ratio: float = 1.0):
    """Start B, then A (which calls B); yield a plain channel to A and both Tracings."""
    tracing_a = setup_tracing(TracingConfig("svc-a", endpoint, sampling_ratio))
    tracing_b = setup_tracing(TracingConfig("svc-b", endpoint, sampling_ratio))
    server_b = grpc.aio.server(interceptors=tracing_b.server_interceptors())
    server_b.add_generic_rpc_handlers([_service_b(tracing_b)])
    port_b = server_b.add_insecure_port("127.0.0.1:0")
    await server_b.start()
    channel_to_b = grpc.aio.insecure_channel(
        f"127.0.0.1:{port_b}", interceptors=tracing_a.client_interceptors()
    )
    server_a = grpc.aio.server(interceptors=tracing_a.server_interceptors())
    server_a.add_generic_rpc_handlers([_service_a(channel_to_b)])
    port_a = server_a.add_insecure_port("127.0.0.1:0")
    await server_a.start()
    channel_to_a = grpc.aio.insecure_channel(f"127.0.0.1:{port_a}")
    try:
        yield channel_to_a, tracing_a, tracing_b
    finally:
        await channel_to_a.close()
        await server_a.stop(None)
        await channel_to_b.close()
        await server_b.stop(None)
        tracing_a.shutdown()
        tracing_b.shutdown()


async def _relay(channel: grpc.aio.Channel, metadata: Any = None) -> list[bytes]:
    call = channel.unary_stream("/test.A/Relay")(b"x", metadata=metadata, timeout=10)
    return [item async for item in call]


def _one(spans: list[ReceivedSpan], name: str, kind: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name and span.kind == kind]
    assert len(found) == 1, f"expected one {kind} span {name!r}, got {spans}"
    return found[0]


# ------------------------------------------------------------------ tracing tests


def test_one_trace_with_parent_child_links_across_the_hop() -> None:
    async def scenario(endpoint: str) -> list[bytes]:
        async with _chain(endpoint) as (channel, _, _):
            return await _relay(channel)

    with OtlpReceiver() as receiver:
        items = asyncio.run(scenario(receiver.endpoint))
        assert items == [b"b:x+r1", b"x-0", b"x-1", b"x-2", b"w0", b"w1"]
        # Shutdown flushed both providers: 1 + 3 client + 3 server + 2 handler spans.
        assert receiver.wait_for(lambda spans: len(spans) >= 9, timeout=10)
        traces = receiver.spans_by_trace()

    assert len(traces) == 1, traces
    spans = next(iter(traces.values()))
    assert len(spans) == 9
    root = _one(spans, "test.A/Relay", "SERVER")
    assert root.parent_span_id is None
    assert root.service_name == "svc-a"
    assert root.attributes["rpc.system"] == "grpc"
    assert root.attributes["rpc.grpc.status_code"] == 0
    for method in ("Unary", "Stream", "WrittenStream"):
        client = _one(spans, f"test.B/{method}", "CLIENT")
        server = _one(spans, f"test.B/{method}", "SERVER")
        assert client.service_name == "svc-a" and server.service_name == "svc-b"
        assert client.parent_span_id == root.span_id
        assert server.parent_span_id == client.span_id
        assert client.attributes["rpc.grpc.status_code"] == 0
    # Server-streaming spans cover the whole stream, on both sides of the hop.
    stream_server = _one(spans, "test.B/Stream", "SERVER")
    stream_client = _one(spans, "test.B/Stream", "CLIENT")
    work = _one(spans, "b.work", "INTERNAL")
    assert work.parent_span_id == stream_server.span_id
    queue = _one(spans, "b.queue", "INTERNAL")
    assert queue.parent_span_id == stream_server.span_id
    assert queue.attributes[SpanAttr.REQUEST_ID] == "r1"
    assert stream_server.start_time_ns <= queue.start_time_ns <= queue.end_time_ns
    assert stream_server.end_time_ns >= work.end_time_ns
    assert stream_server.end_time_ns - stream_server.start_time_ns >= 25_000_000
    assert stream_client.end_time_ns >= stream_server.end_time_ns
    assert root.end_time_ns >= stream_client.end_time_ns
    assert sorted(children_of(spans, root), key=lambda s: s.start_time_ns) == [
        _one(spans, f"test.B/{m}", "CLIENT") for m in ("Unary", "Stream", "WrittenStream")
    ]


def test_client_traceparent_is_honoured() -> None:
    async def scenario(endpoint: str) -> None:
        async with _chain(endpoint) as (channel, _, _):
            await _relay(channel, metadata=(("traceparent", _traceparent()),))

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver.endpoint))
        assert receiver.wait_for(lambda spans: len(spans) >= 9, timeout=10)
        traces = receiver.spans_by_trace()

    assert list(traces) == [CLIENT_TRACE_ID]
    root = _one(traces[CLIENT_TRACE_ID], "test.A/Relay", "SERVER")
    assert root.parent_span_id == CLIENT_SPAN_ID


def test_error_status_is_recorded_on_both_sides() -> None:
    async def scenario(endpoint: str) -> grpc.StatusCode:
        async with _chain(endpoint) as (channel, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary("/test.A/RelayBad")(b"x", timeout=10)
            return raised.value.code()

    with OtlpReceiver() as receiver:
        code = asyncio.run(scenario(receiver.endpoint))
        assert receiver.wait_for(lambda spans: len(spans) >= 3, timeout=10)
        spans = receiver.spans()

    assert code == grpc.StatusCode.INVALID_ARGUMENT
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    client = _one(spans, "test.B/Unary", "CLIENT")
    server = _one(spans, "test.B/Unary", "SERVER")
    assert server.attributes["rpc.grpc.status_code"] == invalid
    assert client.attributes["rpc.grpc.status_code"] == invalid
    assert client.status == "ERROR"
    assert server.status == "UNSET"  # a caller's bad input is not a server fault
    assert _one(spans, "test.A/RelayBad", "SERVER").attributes["rpc.grpc.status_code"] == invalid


def test_cancelled_stream_ends_every_span_as_cancelled() -> None:
    async def scenario(endpoint: str) -> None:
        async with _chain(endpoint) as (channel, _, _):
            call = channel.unary_stream("/test.A/RelayEndless")(b"x", timeout=10)
            assert await call.read() == b"tick"
            call.cancel()
            await asyncio.sleep(0.2)  # let the cancellation reach both servers

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver.endpoint))
        assert receiver.wait_for(lambda spans: len(spans) >= 3, timeout=10)
        spans = receiver.spans()

    cancelled = grpc.StatusCode.CANCELLED.value[0]
    assert len(spans) == 3
    for name, kind in [
        ("test.A/RelayEndless", "SERVER"),
        ("test.B/Endless", "CLIENT"),
        ("test.B/Endless", "SERVER"),
    ]:
        assert _one(spans, name, kind).attributes["rpc.grpc.status_code"] == cancelled, spans


def test_sampling_ratio_zero_exports_nothing_unless_the_parent_is_sampled() -> None:
    async def scenario(endpoint: str, metadata: Any) -> None:
        async with _chain(endpoint, sampling_ratio=0.0) as (channel, _, _):
            for _ in range(3):
                await _relay(channel, metadata=metadata)

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver.endpoint, None))
        assert receiver.spans() == [] and receiver.num_exports == 0
        # Parent-based: a caller's sampled traceparent still wins over the local ratio.
        asyncio.run(scenario(receiver.endpoint, (("traceparent", _traceparent(True)),)))
        assert receiver.wait_for(lambda spans: len(spans) >= 27, timeout=10)
        assert list(receiver.spans_by_trace()) == [CLIENT_TRACE_ID]
        receiver.clear()
        asyncio.run(scenario(receiver.endpoint, (("traceparent", _traceparent(False)),)))
        assert receiver.spans() == []


def test_no_endpoint_means_no_interceptors_and_calls_still_work() -> None:
    async def scenario() -> list[bytes]:
        async with _chain(None) as (channel, tracing_a, _):
            assert not tracing_a.is_enabled
            assert tracing_a.server_interceptors() == []
            assert tracing_a.client_interceptors() == []
            assert tracing_a.inject([("k", "v")]) == [("k", "v")]
            return await _relay(channel)

    assert asyncio.run(scenario())[0] == b"b:x+r1"


def test_config_from_flags_and_env() -> None:
    env = {
        "OTEL_SERVICE_NAME": "router-7",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p-1, deployment.environment=dev",
    }
    config = TracingConfig.from_flags_and_env(env, default_service_name="pdserve-router")
    assert config.service_name == "router-7"
    assert config.otlp_endpoint == "http://jaeger:4317"
    assert config.sampling_ratio == 0.25
    assert config.resource_attributes == {"k8s.pod.name": "p-1", "deployment.environment": "dev"}
    flagged = TracingConfig.from_flags_and_env(
        env, default_service_name="x", otlp_endpoint="http://127.0.0.1:4317", sampling_ratio=1.0
    )
    assert (flagged.otlp_endpoint, flagged.sampling_ratio) == ("http://127.0.0.1:4317", 1.0)
    assert TracingConfig.from_flags_and_env({}, default_service_name="x").otlp_endpoint is None
    disabled = TracingConfig.from_flags_and_env(
        {**env, "OTEL_SDK_DISABLED": "true"}, default_service_name="x"
    )
    assert not disabled.is_enabled
    with pytest.raises(ValueError, match="sampling_ratio"):
        TracingConfig("x", "http://127.0.0.1:4317", sampling_ratio=1.5)
    with pytest.raises(ValueError, match="otlp endpoint"):
        TracingConfig("x", "http://no-port-here")


# ------------------------------------------------------------------ metrics


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_scraped_over_http_move_as_recorded() -> None:
    router, decode = ServiceMetrics(), ServiceMetrics()
    server = start_metrics_server(decode.registry, "127.0.0.1", 0)
    other = start_metrics_server(router.registry, "127.0.0.1", 0)
    try:
        assert server.port > 0 and server.port != other.port
        before = _scrape(server.url)
        for outcome in OUTCOMES:
            assert before[("pdserve_requests_total", (("outcome", outcome),))] == 0

        decode.ttft_seconds.observe(0.03)
        decode.ttft_seconds.observe(0.2)
        decode.tpot_seconds.observe(0.004)
        decode.set_queue(num_waiting=3, num_running=2)
        decode.set_kv_blocks(num_used=10, num_free=54, num_held_for_peer=4)
        decode.record_transfer(4096, 0.5)
        decode.record_transfer(1024, 0.25)
        decode.lease_expiries.inc()
        decode.record_outcome("ok")
        decode.record_outcome("ok")
        decode.record_outcome("cancelled")
        with pytest.raises(ValueError, match="outcome"):
            decode.record_outcome("weird")

        after = _scrape(server.url)
        assert after[("pdserve_ttft_seconds_count", ())] == 2
        assert after[("pdserve_ttft_seconds_sum", ())] == pytest.approx(0.23)
        assert after[("pdserve_ttft_seconds_bucket", (("le", "0.05"),))] == 1
        assert after[("pdserve_tpot_seconds_count", ())] == 1
        assert after[("pdserve_queue_depth", ())] == 3
        assert after[("pdserve_running_requests", ())] == 2
        assert after[("pdserve_kv_blocks_used", ())] == 10
        assert after[("pdserve_kv_blocks_free", ())] == 54
        assert after[("pdserve_kv_blocks_held_for_peer", ())] == 4
        assert after[("pdserve_kv_transfer_bytes_total", ())] == 5120
        assert after[("pdserve_kv_transfer_seconds_total", ())] == pytest.approx(0.75)
        assert after[("pdserve_lease_expiries_total", ())] == 1
        assert after[("pdserve_requests_total", (("outcome", "ok"),))] == 2
        assert after[("pdserve_requests_total", (("outcome", "cancelled"),))] == 1
        # Registries are per service: the router's endpoint saw none of it.
        assert _scrape(other.url)[("pdserve_requests_total", (("outcome", "ok"),))] == 0
    finally:
        server.stop()
        other.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)
    server.stop()  # idempotent


def test_http_middleware_spans_traced_routes_only_and_marks_server_errors() -> None:
    """The HTTP front's middleware: a SERVER span per traced route, continuing a traceparent header;
    the span is current in the handler; a 5xx marks it failed, a 4xx does not; other paths go untraced."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from shared.serving.server.http_tracing import HttpTracingMiddleware

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    seen_in_handler = []

    async def answer(request):
        seen_in_handler.append(trace.get_current_span().get_span_context().span_id)
        return Response(status_code=int(request.query_params.get("status", 200)))

    app = Starlette(routes=[Route("/traced", answer, methods=["POST"]), Route("/probe", answer)])
    traced = HttpTracingMiddleware(app, lambda: provider.get_tracer("test"), traced_paths=("/traced",))
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with TestClient(traced) as client:
        client.post("/traced", headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        client.post("/traced?status=503")
        client.post("/traced?status=400")
        client.get("/probe")
    ok, failed, refused = exporter.get_finished_spans()
    assert ok.name == "POST /traced" and ok.kind.name == "SERVER"
    assert format(ok.context.trace_id, "032x") == trace_id and format(ok.parent.span_id, "016x") == parent_id
    assert seen_in_handler[0] == ok.context.span_id
    assert ok.attributes["http.response.status_code"] == 200 and ok.status.status_code.name == "UNSET"
    assert failed.parent is None and failed.status.status_code.name == "ERROR"
    assert refused.attributes["http.response.status_code"] == 400 and refused.status.status_code.name == "UNSET"
