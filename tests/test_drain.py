"""shared.serving.server.drain: on shutdown, gRPC calls and HTTP requests in flight drain together under one grace
deadline; those that cannot finish end with an error the client reads (gRPC UNAVAILABLE with a message, an
SSE error event) rather than a cut connection; the drain's start and end are logged with counts."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import httpx
import pytest

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from shared.serving.server.drain import SHUTDOWN_MESSAGE, DrainMiddleware
from shared.serving.server.grpc_server import GrpcServer, ServerOptions
from shared.serving.server.http_server import HttpServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
CHUNK_INTERVAL_S = 0.05


class _SlowGenerate(generate_pb2_grpc.GenerateServiceServicer):
    """Streams max_tokens chunks, one every CHUNK_INTERVAL_S."""

    async def Generate(self, request, context):
        for index in range(request.sampling.max_tokens):
            await asyncio.sleep(CHUNK_INTERVAL_S)
            yield generate_pb2.GenerateResponse(token_ids=[index])


def _events_app(num_events: int):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for index in range(num_events):
            await asyncio.sleep(CHUNK_INTERVAL_S)
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps({'n': index})}\n\n".encode()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return app


async def _serve(grace_s: float, num_tokens: int):
    """A gRPC server and an HTTP front draining together, as the router and colocated pods run them."""
    server = GrpcServer(ServerOptions(host="127.0.0.1", port=0, grace_seconds=grace_s))
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, _SlowGenerate(),
                       "pdserve.v1.GenerateService")
    await server.start()
    http = HttpServer(_events_app(num_tokens), "127.0.0.1", 0)
    server.drain_beside(http.stop)
    await http.start(server.drain)
    return server, http.url


async def _grpc_stream(address: str, num_tokens: int, under_way: asyncio.Queue) -> dict:
    received = 0
    async with grpc.aio.insecure_channel(address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            generate_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=num_tokens)))
        try:
            async for _ in call:
                received += 1
                if received == 1:
                    under_way.put_nowait("grpc")
        except grpc.aio.AioRpcError as error:
            return {"received": received, "code": error.code(), "details": error.details()}
    return {"received": received, "code": grpc.StatusCode.OK}


async def _http_stream(url: str, under_way: asyncio.Queue) -> dict:
    events = []
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("GET", url) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        under_way.put_nowait("http")
    return {"received": sum(1 for e in events if e.startswith('{"n"')), "last": events[-2:]}


def _drain_scenario(grace_s: float, num_tokens: int, caplog) -> tuple[list[dict], float]:
    async def scenario():
        server, url = await _serve(grace_s, num_tokens)
        under_way = asyncio.Queue()
        streams = [asyncio.ensure_future(_grpc_stream(server.address, num_tokens, under_way)) for _ in range(2)]
        streams += [asyncio.ensure_future(_http_stream(url, under_way)) for _ in range(2)]
        for _ in streams:  # every stream has its first token: each call is in flight on the server
            await asyncio.wait_for(under_way.get(), timeout=20)
        assert not any(stream.done() for stream in streams)
        started = time.monotonic()
        await server.stop()
        return await asyncio.gather(*streams), time.monotonic() - started

    with caplog.at_level(logging.INFO, logger="shared.serving.server.drain"):
        return asyncio.run(scenario())


def test_streams_of_both_fronts_finish_within_the_grace_and_the_drain_is_logged(caplog):
    results, seconds = _drain_scenario(grace_s=10, num_tokens=40, caplog=caplog)  # about 2 s of streaming
    assert seconds < 10
    assert results[0]["code"] == results[1]["code"] == grpc.StatusCode.OK
    assert all(result["received"] == 40 for result in results)
    assert results[2]["last"][-1] == "[DONE]"
    lines = [record.getMessage() for record in caplog.records]
    assert any("drain started: 2 gRPC call(s) and 2 HTTP request(s) in flight" in line for line in lines)
    assert any("drain finished" in line and "4 finished and 0 were ended" in line for line in lines)


def test_streams_that_cannot_finish_end_with_an_error_before_the_deadline(caplog):
    results, seconds = _drain_scenario(grace_s=2, num_tokens=1000, caplog=caplog)  # 50 s of streaming
    assert seconds < 2 + 0.5
    for result in results[:2]:
        assert result["code"] == grpc.StatusCode.UNAVAILABLE and result["details"] == SHUTDOWN_MESSAGE
        assert 0 < result["received"] < 1000
    for result in results[2:]:
        error, done = result["last"]
        assert json.loads(error)["error"]["message"] == SHUTDOWN_MESSAGE and done == "[DONE]"
        assert 0 < result["received"] < 1000
    lines = [record.getMessage() for record in caplog.records]
    assert any("0 finished and 4 were ended with an error at its deadline (2 gRPC, 2 HTTP)" in line
               for line in lines)
