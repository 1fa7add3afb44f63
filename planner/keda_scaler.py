"""KEDA's external scaler protocol, served: each ScaledObject names its tier in the trigger's metadata
("tier": prefill or decode) and gets the planner's desired replica count as its metric, with a target
of 1 per replica, so KEDA's HPA runs exactly that many."""
from __future__ import annotations

import asyncio

import grpc

from planner.decision import TIERS
from proto.externalscaler import externalscaler_pb2 as pb

SERVICE_NAME = "externalscaler.ExternalScaler"
TIER_KEY = "tier"


class DesiredReplicas:
    """The latest decision's counts, shared by the planning loop (writer) and the scaler (readers)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.counts = {"prefill": prefill, "decode": decode}
        self.version = 0  # bumped on every publish: a waiter never misses one made while it was busy
        self._changed = asyncio.Condition()

    async def publish(self, prefill: int, decode: int) -> None:
        async with self._changed:
            self.counts = {"prefill": prefill, "decode": decode}
            self.version += 1
            self._changed.notify_all()

    async def wait_past(self, version: int) -> None:
        """Returns once a publish after `version` happened."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version > version)


def metric_name(tier: str) -> str:
    return f"pdserve-planner-{tier}-replicas"


class ExternalScalerServicer:
    """IsActive, StreamIsActive, GetMetricSpec, GetMetrics over the planner's DesiredReplicas."""

    def __init__(self, desired: DesiredReplicas) -> None:
        self._desired = desired

    async def _tier(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> str:
        tier = ref.scalerMetadata.get(TIER_KEY, "")
        if tier not in TIERS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"ScaledObject {ref.namespace}/{ref.name}: trigger metadata {TIER_KEY!r} must be one of "
                f"{', '.join(TIERS)}, got {tier!r}"))
        return tier

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        tier = await self._tier(request, context)
        return pb.IsActiveResponse(result=self._desired.counts[tier] > 0)

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        tier = await self._tier(request, context)
        sent = None
        while True:
            version = self._desired.version
            is_active = self._desired.counts[tier] > 0
            if is_active != sent:
                yield pb.IsActiveResponse(result=is_active)
                sent = is_active
            await self._desired.wait_past(version)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        tier = await self._tier(request, context)
        return pb.GetMetricSpecResponse(metricSpecs=[
            pb.MetricSpec(metricName=metric_name(tier), targetSize=1, targetSizeFloat=1.0)
        ])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        tier = await self._tier(request.scaledObjectRef, context)
        count = self._desired.counts[tier]
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=request.metricName or metric_name(tier), metricValue=count,
                           metricValueFloat=float(count))
        ])
