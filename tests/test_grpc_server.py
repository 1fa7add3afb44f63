"""shared.serving.server.grpc_server: health goes NOT_SERVING -> SERVING -> NOT_SERVING across start/ready/shutdown,
reflection lists the services, and an unexpected handler exception becomes INTERNAL."""
import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.pdserve.v1 import generate_pb2, generate_pb2_grpc
from raw_grpc import GARBAGE, call_with_raw_bytes
from shared.serving.server.grpc_server import GrpcServer, ServerOptions, serve_until_stopped

pytestmark = pytest.mark.e2e

SERVICE = "pdserve.v1.GenerateService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class BrokenGenerate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(token_ids=[1])
        raise RuntimeError("boom")


def make_server(servicer=None, **kwargs) -> GrpcServer:
    server = GrpcServer(ServerOptions(host="127.0.0.1", port=0, grace_seconds=1.0, **kwargs))
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer or BrokenGenerate(), SERVICE)
    return server


async def check(stub, service=""):
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return response.status


class LateGenerate(generate_pb2_grpc.GenerateServiceServicer):
    """Fails its abort because the call's deadline ended the call first (the router's race)."""

    def __init__(self):
        self.raised = asyncio.Event()

    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(token_ids=[1])
        try:
            await asyncio.sleep(30)  # the deadline ends the call and cancels this wait
        except asyncio.CancelledError:
            pass  # as the router's handler, mapping its own downstream DEADLINE_EXCEEDED to an abort
        try:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
        finally:
            self.raised.set()


def test_an_error_after_the_call_ended_is_not_reported_as_unexpected(caplog):
    async def scenario():
        servicer = LateGenerate()
        server = make_server(servicer)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(generate_pb2.GenerateRequest(text="x"), timeout=0.3):
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(servicer.raised.wait(), 5)
            await asyncio.sleep(0.1)
        finally:
            await server.stop(0)

    with caplog.at_level("INFO", logger="shared.serving.server.grpc_server"):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "after the call had ended" in caplog.text


@pytest.mark.timeout(30)
def test_health_lifecycle():
    async def scenario():
        server = make_server()
        await server.start()
        seen_during_shutdown = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert await check(stub) == NOT_SERVING
            assert await check(stub, SERVICE) == NOT_SERVING
            await server.set_serving(True)
            assert await check(stub) == SERVING
            assert await check(stub, SERVICE) == SERVING

            async def record():
                seen_during_shutdown.append((await check(stub), await check(stub, SERVICE)))

            server.on_shutdown(record)
            await server.stop()
            # Flipping back after shutdown began must be ignored.
            await server.set_serving(True)
        assert seen_during_shutdown == [(NOT_SERVING, NOT_SERVING)]

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_serve_forever_stops_on_request():
    async def scenario():
        server = make_server()
        task = asyncio.create_task(server.serve_forever(handle_signals=False))
        while not server.is_started:
            await asyncio.sleep(0.01)
        server.request_stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_serve_until_stopped_announces_then_stops_and_closes_newest_first(capsys):
    events = []

    async def scenario():
        server = make_server()
        closers = contextlib.AsyncExitStack()
        closers.callback(events.append, "closed first registered")
        closers.callback(events.append, "closed last registered")

        async def start():
            await server.start()
            server.on_shutdown(lambda: events.append("on_shutdown"))
            return ["svc listening on here", "svc metrics at there"]

        task = asyncio.create_task(serve_until_stopped(server, start, closers))
        while not server.is_started:
            await asyncio.sleep(0.01)
        server.request_stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert capsys.readouterr().out == "svc listening on here\nsvc metrics at there\n"
    assert events == ["on_shutdown", "closed last registered", "closed first registered"]


@pytest.mark.timeout(30)
def test_serve_until_stopped_stops_and_closes_when_start_fails(capsys):
    closed = []

    async def scenario():
        server = make_server()
        closers = contextlib.AsyncExitStack()
        closers.callback(closed.append, True)

        async def start():
            await server.start()
            raise OSError("the model did not load")

        with pytest.raises(OSError, match="did not load"):
            await serve_until_stopped(server, start, closers)
        assert server.shutdown_seconds_left() < server.options.grace_seconds  # stop() ran

    asyncio.run(scenario())
    assert closed == [True]
    assert capsys.readouterr().out == ""


@pytest.mark.timeout(30)
def test_reflection_lists_services():
    async def scenario():
        server = make_server()
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = []
                async for response in call:
                    names = [s.name for s in response.list_services_response.service]
                    break
                call.cancel()
        finally:
            await server.stop(0)
        assert SERVICE in names
        assert "grpc.health.v1.Health" in names
        assert "grpc.reflection.v1alpha.ServerReflection" in names

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_unexpected_exception_maps_to_internal():
    async def scenario():
        server = make_server()
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for chunk in stub.Generate(generate_pb2.GenerateRequest(text="x"), timeout=5):
                        received.append(list(chunk.token_ids))
                assert received == [[1]]
                assert info.value.code() == grpc.StatusCode.INTERNAL
                assert "RuntimeError" in info.value.details()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_oversized_message_is_rejected():
    async def scenario():
        server = make_server(max_message_bytes=4096)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(generate_pb2.GenerateRequest(text="x" * 10000), timeout=5):
                        pass
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="port"):
        ServerOptions(port=70000)
    with pytest.raises(ValueError, match="grace_seconds"):
        ServerOptions(grace_seconds=-1)


# (method path, streams its response, streams its request)
SERVER_METHODS = [
    (f"/{SERVICE}/Generate", True, False),
    ("/grpc.health.v1.Health/Check", False, False),
    ("/grpc.health.v1.Health/Watch", True, False),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method,is_stream_response,is_stream_request", SERVER_METHODS)
def test_malformed_bytes_get_invalid_argument_and_one_log_line(method, is_stream_response, is_stream_request,
                                                                 caplog):
    async def scenario():
        server = make_server()
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                with caplog.at_level("WARNING", logger="shared.serving.server.grpc_server"):
                    error = await call_with_raw_bytes(
                        channel, method, is_stream_response, is_stream_request, GARBAGE
                    )
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
                assert "malformed request message" in error.details() and method in error.details()
                # The server still answers well-formed calls.
                health = health_pb2_grpc.HealthStub(channel)
                assert await check(health) == NOT_SERVING
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    logged = [r for r in caplog.records if r.name == "shared.serving.server.grpc_server" and "malformed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None
