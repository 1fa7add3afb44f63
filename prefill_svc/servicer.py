"""PrefillService: computes a prompt, samples token 1, and holds the prompt's KV blocks for a decode pod.
Traces each call (prefill-queue, prefill compute, kv-hold) and counts it by outcome."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from shared.serving.wire.common import load_report_to_proto
from shared.serving.wire.prefill import kv_source_to_proto, prefill_request_from_proto, prefill_result_to_proto
from shared.serving.wire import payloads as wire
from shared.engine.kv_transfer.handle import KvHandle
from shared.engine.kv_transfer.handoff import HoldForPeer
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.outcomes import InvalidRequest, PodUnavailable, invalid_on_value_error
from shared.serving.pod.servicer import PodServicer
from shared.engine.request import FinishReason, Request
from shared.serving.server.telemetry import SpanAttr

logger = logging.getLogger(__name__)

# kv-hold span outcomes (SpanAttr.KV_OUTCOME).
HOLD_RELEASED = "released"  # the decode pod confirmed its pull in time: the data it read is good
HOLD_EXPIRED = "expired"  # the lease ran out first: the blocks were freed, a late pull is refused
HOLD_SHUTDOWN = "shutdown"  # the pod stopped while holding


@dataclass
class _HoldSpan:
    """A hold being traced: its span is recorded when the hold ends, under the Prefill SERVER span."""

    parent: otel_context.Context
    start_ns: int
    deadline_ns: int
    num_blocks: int
    timer: asyncio.TimerHandle | None = None


class PrefillServicer(PodServicer, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, metrics: ServiceMetrics):
        super().__init__()
        self.metrics = metrics
        self._hold_spans: dict[str, _HoldSpan] = {}

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        async with await self.start_call(context, "prefill") as call:
            with invalid_on_value_error():
                work = prefill_request_from_proto(request, vocab_size=self.pod.vocab_size)
                sampling = self.pod.fill_sampling(work.sampling, len(work.prompt_token_ids))
                work = dataclasses.replace(work, sampling=sampling)
            call.span.set_attribute(SpanAttr.REQUEST_ID, work.request_id)
            call.span.set_attribute(SpanAttr.NUM_PROMPT_TOKENS, len(work.prompt_token_ids))
            # Token 1 only: the rest is the decode pod's. The original params decide the handoff.
            stream = call.submit(Request(
                work.request_id,
                work.prompt_token_ids,
                # min_tokens only matters at position 0 here (it holds EOS and stop tokens back).
                dataclasses.replace(work.sampling, max_tokens=1, min_tokens=min(work.sampling.min_tokens, 1)),
                eos_token_id=self.pod.eos_token_id,
                kv_transfer_params=HoldForPeer(max_tokens=work.sampling.max_tokens),
            ))
            tokens, logprobs, prompt_logprobs, final = [], [], [], None
            async for output in stream:
                tokens.extend(output.new_token_ids)
                logprobs.extend(output.new_logprobs or ())
                prompt_logprobs.extend(output.new_prompt_logprobs or ())
                final = output
            if final is None:
                raise PodUnavailable("the pod stopped the request before token 1")
            if final.finished:
                call.engine_request_finished()
            # The filled params go back with token 1: the router decodes with them, so the tiers agree.
            result = self._result(work, final, tokens, call.parent)
            result = dataclasses.replace(result, resolved_sampling=work.sampling, prompt_logprobs=prompt_logprobs)
            if result.handle is not None:
                self._free_hold_if_cancelled(context, work.request_id)
            if logprobs:
                result = dataclasses.replace(result, first_token_logprobs=logprobs[0])
            call.count_tokens(1)
            call.span.set_attribute(SpanAttr.NUM_OUTPUT_TOKENS, 1)
            if result.finish_reason is not None:
                call.span.set_attribute(SpanAttr.FINISH_REASON, result.finish_reason.value)
            return prefill_result_to_proto(result)

    def _free_hold_if_cancelled(self, context: grpc.aio.ServicerContext, request_id: str) -> None:
        """A caller that hangs up while the answer goes out never learns the handle: end the hold
        then instead of at the lease's end."""

        def on_done(done_context) -> None:
            if done_context.cancelled():
                self.pod.loop.abort(request_id)

        context.add_done_callback(on_done)

    def _result(self, work: wire.PrefillInput, final, tokens: list[int], parent) -> wire.PrefillResult:
        if final.error is not None:
            raise InvalidRequest(final.error)
        if final.finish_reason is FinishReason.ERROR or not tokens:
            raise RuntimeError(f"prefill of {work.request_id} ended with {final.finish_reason} and no token")
        token_id = tokens[0]
        num_prompt = len(work.prompt_token_ids)
        if final.kv_handle is None:
            # Token 1 ended the request (stop token, max_tokens 1, the model's length): nobody pulls.
            return wire.PrefillResult(token_id, num_prompt, finish_reason=final.finish_reason)
        self._trace_hold(work.request_id, final.kv_handle, parent)
        return wire.PrefillResult(token_id, num_prompt, handle=final.kv_handle)

    # ---- kv-hold spans -------------------------------------------------------------------------
    def _trace_hold(self, request_id: str, handle: KvHandle, parent) -> None:
        if parent is None:
            return
        deadline_ns = handle.lease_deadline_unix_ms * 1_000_000
        # The connector set the deadline to (hold start + lease) when the request finished.
        start_ns = min(deadline_ns - int(self.pod.config.lease_s * 1e9), time.time_ns())
        hold = _HoldSpan(parent, start_ns, deadline_ns, len(handle.block_ids))
        self._hold_spans[request_id] = hold
        # The connector frees an expired hold at its deadline; the span ends there too.
        delay_s = max(0.0, (deadline_ns - time.time_ns()) / 1e9)
        hold.timer = asyncio.get_running_loop().call_later(delay_s, self._end_hold_span, request_id, HOLD_EXPIRED)

    def _end_hold_span(self, request_id: str, outcome: str) -> None:
        hold = self._hold_spans.pop(request_id, None)
        if hold is None:
            return
        if hold.timer is not None:
            hold.timer.cancel()
        end_ns = hold.deadline_ns if outcome == HOLD_EXPIRED else time.time_ns()
        self.record_span(
            "kv-hold", hold.parent, hold.start_ns, end_ns,
            {
                SpanAttr.REQUEST_ID: request_id,
                SpanAttr.KV_BLOCKS: hold.num_blocks,
                SpanAttr.KV_OUTCOME: outcome,
                SpanAttr.KV_ENGINE_ID: self.pod.engine_id,
            },
        )

    async def close(self) -> None:
        for request_id in list(self._hold_spans):
            self._end_hold_span(request_id, HOLD_SHUTDOWN)

    # ---- the decode pod's calls ----------------------------------------------------------------
    async def GetKvSource(self, request, context):
        await self.require_pod(context)
        return kv_source_to_proto(self.pod.kv_source())

    async def ReserveKv(self, request: prefill_pb2.ReserveKvRequest, context):
        await self.require_pod(context)
        reserved = self.pod.connector.reserve(request.request_id, request.engine_id, request.prompt_digest)
        span = trace.get_current_span()
        span.set_attribute(SpanAttr.REQUEST_ID, request.request_id)
        span.set_attribute("pdserve.kv.reserved", reserved)
        return prefill_pb2.ReserveKvResponse(reserved=reserved)

    async def ReleaseKv(self, request: prefill_pb2.ReleaseKvRequest, context):
        await self.require_pod(context)
        engine_id = request.engine_id or self.pod.engine_id
        intact = self.pod.connector.release(request.request_id, engine_id, request.prompt_digest)
        if engine_id == self.pod.engine_id:
            self._end_hold_span(request.request_id, HOLD_RELEASED if intact else HOLD_EXPIRED)
        span = trace.get_current_span()
        span.set_attribute(SpanAttr.REQUEST_ID, request.request_id)
        span.set_attribute("pdserve.kv.intact", intact)
        return prefill_pb2.ReleaseKvResponse(intact=intact)

    async def GetLoad(self, request, context):
        await self.require_pod(context)
        return common_pb2.GetLoadResponse(
            load=load_report_to_proto(self.pod.load_report()), engine_id=self.pod.engine_id
        )
