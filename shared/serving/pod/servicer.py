"""Base of the pod servicers: registered before the model loads, attached to the pod once ready; admission
(refused while loading or draining), the call lifecycle's entry points and the tracing helpers."""
from __future__ import annotations

import time
from typing import Any, Mapping

import grpc
from opentelemetry import context as otel_context

from shared.serving.generation import CallEnded
from shared.serving.pod.call import PodCall, call_ended
from shared.serving.pod.engine_thread import RequestTimeline
from shared.serving.pod.outcomes import CallError, PodUnavailable, status_of
from shared.serving.pod.runtime import Pod
from shared.serving.server.telemetry import SpanAttr, Tracing, TracingConfig, record_span


class PodServicer:
    """Base of the pod servicers: registered before the model loads, attached to the pod once ready.
    Holds the service's tracing (a disabled one until run_pod hands the real one over)."""

    def __init__(self) -> None:
        self.pod: Pod | None = None
        self.tracing = Tracing(TracingConfig(service_name="pdserve-pod"), None)
        self.is_draining = False

    def use_tracing(self, tracing: Tracing) -> None:
        """Called before the server starts (client channels made later carry its interceptors)."""
        self.tracing = tracing

    def attach(self, pod: Pod) -> None:
        self.pod = pod

    async def close(self) -> None:
        """Shutdown, after the pod stopped: end what the servicer still tracks."""

    async def require_pod(self, context) -> Pod:
        if self.pod is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the pod is still loading its model")
        return self.pod

    async def admit(self, context) -> Pod:
        """require_pod for calls that start new work: none once the pod drains for shutdown."""
        if self.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the pod is shutting down")
        return await self.require_pod(context)

    async def start_call(self, context, tier: str | None) -> PodCall:
        """Admit a call that starts new work; use the result as `async with`."""
        await self.admit(context)
        return PodCall(self, context, tier)

    def admitted_pod(self) -> Pod:
        """The pod, for work called in process; PodUnavailable while it loads or drains for shutdown."""
        if self.is_draining:
            raise PodUnavailable("the pod is shutting down")
        if self.pod is None:
            raise PodUnavailable("the pod is still loading its model")
        return self.pod

    def start_local_call(self, tier: str | None) -> PodCall:
        """start_call for work called in process (no gRPC call): a failure raises CallEnded with its status."""
        try:
            self.admitted_pod()
        except CallError as exc:
            raise call_ended(exc) from None
        return PodCall(self, None, tier)

    def refused(self, error: CallError) -> CallEnded:
        """The end of in-process work that started nothing, counted by its outcome (as refuse() does)."""
        self.metrics.record_outcome(status_of(error)[1])
        return call_ended(error)

    # ---- tracing helpers (all no-ops when tracing is off) -------------------------------------
    def trace_parent(self) -> otel_context.Context | None:
        """The handler's context (its SERVER span) to parent spans recorded later; None when off."""
        return otel_context.get_current() if self.tracing.is_enabled else None

    def record_span(
        self, name: str, parent: otel_context.Context | None, start_ns: int | None, end_ns: int | None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A finished span measured elsewhere; skipped when tracing is off or a stage was never reached."""
        if parent is None or start_ns is None or end_ns is None:
            return
        record_span(self.tracing.tracer, name, parent, start_ns, max(start_ns, end_ns), attributes)

    def record_stage_spans(
        self, tier: str, parent: otel_context.Context | None, timeline: RequestTimeline,
        attributes: Mapping[str, Any], end_ns: int | None = None,
    ) -> None:
        """`{tier}-queue` (arrival to first scheduled) and `{tier}` compute (first computing step to
        the finished output, or `end_ns` for a request that ended early)."""
        if parent is None:
            return
        end_ns = timeline.finished_ns or end_ns or time.time_ns()
        queued = {key: attributes[key] for key in (SpanAttr.REQUEST_ID,) if key in attributes}
        self.record_span(f"{tier}-queue", parent, timeline.submitted_ns, timeline.scheduled_ns or end_ns, queued)
        self.record_span(tier, parent, timeline.computing_ns, end_ns, attributes)
