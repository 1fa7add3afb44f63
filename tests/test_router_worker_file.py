"""The router's worker list files (`--decode file:PATH`): the pool follows the file's host:port lines as it
is rewritten, keeps its last set when the file cannot be read, and exports its rotation set as a gauge
(what `pdserve up --autoscale` waits on before it stops a pod)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from proto.pdserve.v1 import decode_pb2_grpc
from router.flags import PoolConfig, WorkerSpec, parse_worker_list, parse_worker_spec, read_worker_file
from router.metrics import RouterMetrics
from router.workers import WorkerPool
from test_router_servicer import Cluster, FakeDecode, FakePrefill, expected_output, tokens


def test_file_specs_parse_and_name_bad_lines(tmp_path):
    assert parse_worker_spec("file:/x/decode.pods") == WorkerSpec("", 0, list_file="/x/decode.pods")
    assert str(parse_worker_spec("file:/x/decode.pods")) == "file:/x/decode.pods"
    assert parse_worker_spec("file:/x").is_dynamic and parse_worker_spec("dns:a:1").is_dynamic
    assert not parse_worker_spec("a:1").is_dynamic
    assert parse_worker_list(["a:1,file:/p"]) == (WorkerSpec("a", 1), WorkerSpec("", 0, list_file="/p"))
    with pytest.raises(ValueError, match="file:PATH"):
        parse_worker_spec("file:")
    listing = tmp_path / "pods"
    listing.write_text("# decode pods\n127.0.0.1:7001\n\n[::1]:7002  # v6\n127.0.0.1:7001\n")
    assert read_worker_file(str(listing)) == ["127.0.0.1:7001", "[::1]:7002"]
    listing.write_text("127.0.0.1:7001\nnot an address\n")
    with pytest.raises(ValueError, match="line 2"):
        read_worker_file(str(listing))
    listing.write_text("dns:decode:7001\n")
    with pytest.raises(ValueError, match="host:port lines only"):
        read_worker_file(str(listing))


def test_the_pool_follows_the_file_and_the_gauge_shows_its_rotation(tmp_path):
    listing = tmp_path / "decode.pods"
    listing.write_text("127.0.0.1:7001\n127.0.0.1:7002\n")
    metrics = RouterMetrics(CollectorRegistry())

    async def scenario():
        pool = WorkerPool("decode", [parse_worker_spec(f"file:{listing}")], decode_pb2_grpc.DecodeServiceStub,
                          "pdserve.v1.DecodeService", PoolConfig())
        metrics.watch_workers({"decode": pool.health_by_address})
        try:
            await pool.resolve()
            assert pool.addresses == ["127.0.0.1:7001", "127.0.0.1:7002"]
            exported = generate_latest(metrics.registry).decode()
            assert 'pdserve_router_workers{address="127.0.0.1:7002",tier="decode"} 0.0' in exported
            listing.write_text("127.0.0.1:7001\n127.0.0.1:7003\n")
            await pool.resolve()
            assert pool.addresses == ["127.0.0.1:7001", "127.0.0.1:7003"]
            exported = generate_latest(metrics.registry).decode()
            assert "7002" not in exported and 'address="127.0.0.1:7003"' in exported
            listing.unlink()
            await pool.resolve()  # unreadable: the last set stands
            assert pool.addresses == ["127.0.0.1:7001", "127.0.0.1:7003"]
        finally:
            await pool.close()

    asyncio.run(scenario())


class _SlowPrefill(FakePrefill):
    """Answers a second after the call arrives: long enough to scale the pod down meanwhile."""

    def __init__(self):
        super().__init__()
        self.arrived = asyncio.Event()

    async def Prefill(self, request, context):
        self.arrived.set()
        await asyncio.sleep(1.0)
        return await super().Prefill(request, context)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_prefill_pod_leaving_the_rotation_finishes_the_call_it_is_computing():
    async def scenario():
        prefill, decode = _SlowPrefill(), FakeDecode()
        async with Cluster([prefill], [decode]) as cluster:
            request = asyncio.ensure_future(cluster.generate([5, 6, 7], max_tokens=4))
            await asyncio.wait_for(prefill.arrived.wait(), 10)
            cluster.prefill_pool.specs = ()  # as when its address leaves the worker list file
            await cluster.prefill_pool.resolve()
            assert cluster.prefill_pool.addresses == []
            chunks = await asyncio.wait_for(request, 20)
        assert tokens(chunks) == expected_output([5, 6, 7], 4)

    asyncio.run(scenario())


class _SlowHealth(health_pb2_grpc.HealthServicer):
    """Answers a health probe half a second after it arrives, NOT_SERVING (so no load probe follows)."""

    def __init__(self):
        self.arrived = asyncio.Event()

    async def Check(self, request, context):
        self.arrived.set()
        await asyncio.sleep(0.5)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_worker_leaving_the_list_under_a_probe_is_closed_after_the_probe_not_under_it(tmp_path, caplog):
    """Closing a removed worker's channel under its probe would cancel the probe inside the poll round (a
    CancelledError there once ended the tier's health loop for good)."""
    listing = tmp_path / "decode.pods"

    async def scenario():
        health = _SlowHealth()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        listing.write_text(f"127.0.0.1:{port}\n")
        pool = WorkerPool("decode", [parse_worker_spec(f"file:{listing}")], decode_pb2_grpc.DecodeServiceStub,
                          "pdserve.v1.DecodeService", PoolConfig())
        try:
            await pool.resolve()
            poll_round = asyncio.create_task(pool.poll())
            await asyncio.wait_for(health.arrived.wait(), 10)
            listing.write_text("")
            await pool.resolve()  # the worker leaves while its probe is in flight
            assert pool.addresses == []
            await asyncio.wait_for(poll_round, 10)
        finally:
            await pool.close()
            await server.stop(None)

    with caplog.at_level(logging.INFO, logger="router.workers"):
        asyncio.run(scenario())
    assert "a probe ended with" not in caplog.text
    assert "health says NOT_SERVING" in caplog.text  # the probe ran to its answer
