"""shared.serving.server.grpc_server: liveness (the "liveness" health service) is SERVING whenever the process
works, apart from readiness (the overall status); a shutdown's callbacks and the server's stop share one
grace deadline. decode_svc.transport_probe: the transport name follows locality and UCX_TLS."""
import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.kv_sources import KvSourceCache, KvSourceUnavailable
from decode_svc.transport_probe import ProbeResult, derive_transport
from proto.pdserve.v1 import generate_pb2_grpc
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvRegion, KvSource
from shared.serving.server.grpc_server import LIVENESS_SERVICE, GrpcServer, ServerOptions

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _check(stub, service: str) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def _server(grace_seconds: float) -> GrpcServer:
    server = GrpcServer(ServerOptions(host="127.0.0.1", port=0, grace_seconds=grace_seconds))
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server,
                       generate_pb2_grpc.GenerateServiceServicer(), "pdserve.v1.GenerateService")
    return server


@pytest.mark.e2e
@pytest.mark.timeout(30)
def test_liveness_is_serving_while_not_ready_and_while_draining():
    async def scenario():
        server = _server(grace_seconds=2.0)
        await server.start()
        seen = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert await _check(stub, "") == NOT_SERVING  # e.g. a router whose decode tier is down
            assert await _check(stub, LIVENESS_SERVICE) == SERVING
            await server.set_serving(True)
            assert await _check(stub, "") == SERVING

            async def record():
                seen.append((await _check(stub, ""), await _check(stub, LIVENESS_SERVICE)))

            server.on_shutdown(record)
            await server.stop()
        assert seen == [(NOT_SERVING, SERVING)]

    asyncio.run(scenario())


@pytest.mark.e2e
@pytest.mark.timeout(30)
def test_callbacks_and_stop_share_one_grace_deadline():
    async def scenario():
        server = _server(grace_seconds=2.0)
        await server.start()
        left = []

        async def slow_drain():
            await asyncio.sleep(1.5)
            left.append(server.shutdown_seconds_left())

        server.on_shutdown(slow_drain)
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 2.0 + 0.5
        assert 0.0 < left[0] <= 0.6

    asyncio.run(scenario())


def _source(mem_type: str = "DRAM") -> KvSource:
    return KvSource(agent_name="peer", agent_metadata=b"", mem_type=mem_type,
                    regions=(KvRegion(4096, 4096, 0),), block_bytes=4096, num_blocks=1)


def test_transport_of_a_local_peer_is_shared_memory():
    assert derive_transport(_source(), "127.0.0.1:50061") == "cma"
    assert derive_transport(_source("VRAM"), "127.0.0.1:50061", local_mem_type="VRAM") == "cuda_ipc"


def test_transport_between_hosts_is_tcp_without_rdma(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")
    assert derive_transport(_source(), "198.51.100.7:50061") == "tcp"  # TEST-NET-2: no host of ours


class _FailingProbe:
    """A probe whose READ never delivers (as from a frozen peer, or through a closed port range)."""

    def __init__(self):
        self.num_probes = 0

    def probe(self, source, peer_address, transport):
        self.num_probes += 1
        return ProbeResult(peer_address, transport, "20000-20099", "no answer within 5 s")

    def close(self):
        pass


@pytest.mark.parametrize("peer_answers_grpc, counted", [(False, 0), (True, 1)])
def test_a_probe_read_that_fails_counts_only_when_the_peer_is_alive(peer_answers_grpc, counted):
    # A frozen prefill pod serves neither READs nor gRPC: that is no transport failure, and the engine is
    # probed again next time. A pod that answers gRPC but not the READ has a blocked KV path: its handles
    # are not pulled (each pull would wait out its deadline) until a later check.
    async def scenario():
        sources = KvSourceCache(probe_port_range="20000-20099")
        sources._probe = probe = _FailingProbe()
        failures = []
        sources.on_probe_failure = failures.append

        async def describe(handle):
            sources._sources[handle.engine_id] = _source()
            sources._transports[handle.engine_id] = "tcp"
            return _source()

        async def answers(address):
            return peer_answers_grpc

        sources._describe, sources._answers = describe, answers
        handle = KvHandle("engine-1", "198.51.100.7:50061", (1,), 16, 16, KvLayout("tiny", "float32", 2, 2, 8, 16), 0)
        refused = 0
        for _ in range(2):
            try:
                await sources.get(handle)
            except KvSourceUnavailable:
                refused += 1
        await sources.close()
        return len(failures), probe.num_probes, refused

    assert asyncio.run(scenario()) == ((0, 2, 0) if not peer_answers_grpc else (1, 1, 2))
