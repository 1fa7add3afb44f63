"""The planner speaks KEDA's external scaler protocol over real gRPC, as KEDA calls it: GetMetricSpec,
then GetMetrics with the spec's metric name, IsActive, and StreamIsActive (pushed on change); and its
planning loop reads real /metrics endpoints and publishes what it decides to that protocol."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from planner.__main__ import scaler_server
from planner.decision import Planner
from planner.flags import PlannerConfig
from planner.keda_scaler import DesiredReplicas
from planner.loop import PlanningLoop
from planner.metrics import PlannerMetrics
from planner.policy import ScalingPolicy
from planner.scrape import parse_targets
from proto.externalscaler import externalscaler_pb2 as pb
from proto.externalscaler import externalscaler_pb2_grpc
from router.metrics import RouterMetrics
from shared.serving.server.metrics import ServiceMetrics, start_metrics_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def config(**policy) -> PlannerConfig:
    unused = parse_targets(["127.0.0.1:9"])
    return PlannerConfig(router_metrics=unused, prefill_metrics=unused, decode_metrics=unused, port=0,
                         policy=ScalingPolicy(**policy))


def ref(tier: str | None) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=f"pdserve-{tier}", namespace="pdserve",
                              scalerMetadata={"tier": tier} if tier else {})


async def with_scaler(desired: DesiredReplicas, body) -> None:
    server = scaler_server(config(), desired)
    await server.start()
    await server.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await body(externalscaler_pb2_grpc.ExternalScalerStub(channel))
    finally:
        await server.stop(0)


def test_keda_reads_each_tiers_desired_replicas_as_its_metric():
    async def body(stub) -> None:
        for tier, count in (("prefill", 2), ("decode", 5)):
            spec = (await stub.GetMetricSpec(ref(tier), timeout=5)).metricSpecs
            assert len(spec) == 1 and spec[0].targetSizeFloat == 1.0 and spec[0].targetSize == 1
            request = pb.GetMetricsRequest(scaledObjectRef=ref(tier), metricName=spec[0].metricName)
            values = (await stub.GetMetrics(request, timeout=5)).metricValues
            assert [(v.metricName, v.metricValueFloat, v.metricValue) for v in values] == [
                (spec[0].metricName, float(count), count)]
            assert (await stub.IsActive(ref(tier), timeout=5)).result is True

    asyncio.run(with_scaler(DesiredReplicas(prefill=2, decode=5), body))


def test_stream_is_active_sends_at_once_then_on_each_change():
    desired = DesiredReplicas(prefill=1, decode=1)

    async def body(stub) -> None:
        stream = stub.StreamIsActive(ref("decode"), timeout=10)
        assert (await stream.read()).result is True
        await desired.publish(prefill=1, decode=0)
        assert (await stream.read()).result is False
        await desired.publish(prefill=1, decode=0)  # no change: nothing sent
        await desired.publish(prefill=1, decode=3)
        assert (await stream.read()).result is True
        stream.cancel()

    asyncio.run(with_scaler(desired, body))


def test_a_scaled_object_without_a_tier_gets_invalid_argument_naming_it():
    async def body(stub) -> None:
        for call in (stub.GetMetricSpec(ref(None), timeout=5), stub.IsActive(ref("router"), timeout=5)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "'tier'" in caught.value.details() and "prefill, decode" in caught.value.details()

    asyncio.run(with_scaler(DesiredReplicas(prefill=1, decode=1), body))


def test_planning_loop_scrapes_real_endpoints_and_keda_sees_its_decision():
    """Prefill pods report 10,000 prompt tokens per busy second; 40,000 prompt tokens/s arrive at the
    router in 2,000-token prompts: the decision, read back through GetMetrics, asks for more prefill pods."""
    router, prefill, decode = RouterMetrics(CollectorRegistry()), ServiceMetrics(), ServiceMetrics()
    servers = [start_metrics_server(m.registry, "127.0.0.1", 0) for m in (router, prefill, decode)]
    policy = ScalingPolicy(ttft_target_s=1.0, max_prefill=8, interval_s=1.0)
    planner = Planner(policy, num_prefill=1, num_decode=1)
    desired = DesiredReplicas(1, 1)
    targets = {name: parse_targets([f"127.0.0.1:{s.port}"]) for name, s in zip(("router", "prefill", "decode"), servers)}
    loop = PlanningLoop(planner, targets, desired, PlannerMetrics(CollectorRegistry()), scrape_timeout_s=2.0)

    async def body(stub) -> None:
        assert await loop.step() is None  # the baseline
        for _ in range(20):
            router.prompt_tokens.observe(2000)
        prefill.engine_busy_seconds.inc(4.0)
        prefill.engine_tokens.inc(40_000)
        prefill.engine_steps.inc(20)
        await asyncio.sleep(1.0)
        decision = await loop.step()
        assert decision.prefill.desired > 1
        request = pb.GetMetricsRequest(scaledObjectRef=ref("prefill"), metricName="any")
        values = (await stub.GetMetrics(request, timeout=5)).metricValues
        assert values[0].metricValue == decision.prefill.desired

    try:
        asyncio.run(with_scaler(desired, body))
    finally:
        for server in servers:
            server.stop()
