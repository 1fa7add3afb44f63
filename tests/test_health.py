"""gRPC health and reflection of the real services, as OS processes on 127.0.0.1, seen through the
standard clients: NOT_SERVING while a pod loads its model, SERVING once ready, NOT_SERVING again
during a graceful shutdown that still lets the request in flight finish."""
from __future__ import annotations

import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.launcher import HOST, LocalCluster, ServiceProcess, free_port, start_service, wait_serving
from proto.pdserve.v1 import decode_pb2, decode_pb2_grpc
from shared.serving.wire.common import finish_reason_from_proto, sampling_params_to_proto
from shared.engine.request import FinishReason, SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", "16", "--num-blocks", "256"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
GRACE_S = 30.0


def _start_pod(name: str, module: str, log_dir, env: dict[str, str], extra_args=()) -> ServiceProcess:
    port = free_port()
    args = ["--host", HOST, "--port", str(port), *MODEL_ARGS, "--grace-seconds", str(GRACE_S), *extra_args]
    return start_service(name, module, args, address=f"{HOST}:{port}", log_dir=log_dir, env=env)


def _health_answers_until_serving(service: ServiceProcess, service_name: str, timeout_s: float = 90.0) -> list[int]:
    """Every distinct health status, in order, from the first answer after the port opens to SERVING."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    # Retry the connection every few ms: gRPC's default reconnect backoff (1 s and growing) could
    # sleep through the whole loading window while the port is still closed.
    options = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
               ("grpc.max_reconnect_backoff_ms", 50)]
    with grpc.insecure_channel(service.address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert service.is_running(), service.log_tail()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=0.5).status
            except grpc.RpcError:
                time.sleep(0.005)  # not listening yet
                continue
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == SERVING:
                return seen
            time.sleep(0.005)
    pytest.fail(f"{service.name} not SERVING after {timeout_s} s: {seen}\n{service.log_tail()}")


def _check(address: str, service_name: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service_name)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status


def _decode_request(request_id: str, max_tokens: int) -> decode_pb2.DecodeRequest:
    # No handle: the decode pod computes the prompt itself, no prefill pod needed.
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        generated_token_ids=[9],
        sampling=sampling_params_to_proto(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
    )


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    cluster = LocalCluster()
    try:
        cluster.services.append(_start_pod("prefill-0", "prefill_svc", log_dir, cluster.env))
        cluster.services.append(_start_pod("decode-0", "decode_svc", log_dir, cluster.env))
        yield cluster, log_dir
    finally:
        cluster.stop()


def test_pods_are_not_serving_while_loading_then_serving(pods):
    cluster, _ = pods
    pods_by_service = {"pdserve.v1.PrefillService": "prefill-0", "pdserve.v1.DecodeService": "decode-0"}
    # Both pods load at once: watch both from their first answer on, the moment their port opens
    # (the server starts before the model and KV pool load).
    with ThreadPoolExecutor(len(pods_by_service)) as pool:
        answers = dict(zip(pods_by_service, pool.map(
            lambda item: _health_answers_until_serving(cluster.by_name(item[1]), item[0]), pods_by_service.items()
        )))
    for service_name, name in pods_by_service.items():
        assert answers[service_name] == [NOT_SERVING, SERVING], name
        assert _check(cluster.by_name(name).address) == SERVING


def test_every_service_lists_its_services_by_reflection(pods):
    cluster, log_dir = pods
    for service in cluster.services:
        wait_serving(service)
    prefill, decode = cluster.by_name("prefill-0"), cluster.by_name("decode-0")
    router_port = free_port()
    router = start_service(
        "router", "router",
        ["--host", HOST, "--port", str(router_port), f"--prefill={prefill.address}", f"--decode={decode.address}"],
        address=f"{HOST}:{router_port}", log_dir=log_dir,
    )
    cluster.services.append(router)
    wait_serving(router)
    kv_events = "pdserve.v1.KvEventService"
    expected = {
        "router": ("pdserve.v1.GenerateService", set()),
        "prefill-0": ("pdserve.v1.PrefillService", {kv_events}),
        "decode-0": ("pdserve.v1.DecodeService", {kv_events}),
    }
    for name, (service_name, others) in expected.items():
        with grpc.insecure_channel(cluster.by_name(name).address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert set(database.get_services()) == {service_name, *others, HEALTH, REFLECTION}, name
            # The descriptors come along: a client can call without compiled stubs.
            assert database.FindFileContainingSymbol(service_name).name.endswith(".proto")


def test_graceful_shutdown_reports_not_serving_and_finishes_the_request_in_flight(pods):
    cluster, _ = pods
    decode = cluster.by_name("decode-0")
    wait_serving(decode)
    messages: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            with grpc.insecure_channel(decode.address) as channel:
                for message in decode_pb2_grpc.DecodeServiceStub(channel).Decode(
                    _decode_request("in-flight", max_tokens=200), timeout=60
                ):
                    messages.put(message)
        except grpc.RpcError as exc:
            messages.put(exc)
        messages.put(None)

    client = threading.Thread(target=run)
    client.start()
    first = messages.get(timeout=60)
    assert isinstance(first, decode_pb2.DecodeResponse), first
    decode.process.send_signal(signal.SIGTERM)

    # Draining: health says NOT_SERVING (overall and per service) and new work is turned away.
    deadline = time.monotonic() + 5
    while _check(decode.address) != NOT_SERVING:
        assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
        time.sleep(0.01)
    assert _check(decode.address, "pdserve.v1.DecodeService") == NOT_SERVING
    with grpc.insecure_channel(decode.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(_decode_request("late", max_tokens=4), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.is_alive(), "the request finished before the shutdown could be observed"

    # The request in flight still gets every token.
    client.join(timeout=60)
    received = [first]
    while (item := messages.get(timeout=1)) is not None:
        received.append(item)
    assert all(isinstance(message, decode_pb2.DecodeResponse) for message in received), received[-1]
    assert sum(len(message.token_ids) for message in received) == 199  # token 1 was already generated
    assert finish_reason_from_proto(received[-1].finish_reason) == FinishReason.LENGTH
    assert decode.process.wait(timeout=30) == 0
