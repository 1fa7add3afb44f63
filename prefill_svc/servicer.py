"""PrefillService: computes a prompt, samples token 1, and holds the prompt's KV blocks for a decode pod."""
from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from shared import convert
from shared.engine_loop import EngineStopped
from shared.kv_transfer.nixl import DO_REMOTE_DECODE, REMOTE_HANDLE
from shared.metrics import ServiceMetrics
from shared.pod import PodOverloaded
from shared.pod_main import PodServicer
from shared.request import FinishReason, Request, SamplingParams

logger = logging.getLogger(__name__)


def first_token_finish_reason(
    token_id: int, params: SamplingParams, eos_token_id: int | None, num_prompt_tokens: int, max_model_len: int
) -> FinishReason | None:
    """Whether token 1 already ends the request, checked in the scheduler's order (stop tokens, then length)."""
    if token_id in params.stop_token_ids or (token_id == eos_token_id and not params.ignore_eos):
        return FinishReason.STOP
    if params.max_tokens == 1 or num_prompt_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


class PrefillServicer(PodServicer, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, metrics: ServiceMetrics):
        super().__init__()
        self.metrics = metrics

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        await self.require_pod(context)
        started = time.monotonic()
        try:
            work = convert.prefill_request_from_proto(request, vocab_size=self.pod.vocab_size)
            self.pod.check_prompt_fits(len(work.prompt_token_ids))
        except ValueError as exc:
            self.metrics.record_outcome("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Token 1 only: the rest is the decode pod's. The original params decide the handoff.
        engine_request = Request(
            work.request_id,
            work.prompt_token_ids,
            dataclasses.replace(work.sampling, max_tokens=1),
            eos_token_id=self.pod.eos_token_id,
            kv_transfer_params={DO_REMOTE_DECODE: work.sampling.max_tokens > 1},
        )
        final = await self._run(engine_request, context)
        result = self._result(work, final)
        self.metrics.ttft_seconds.observe(time.monotonic() - started)
        self.metrics.record_outcome("ok")
        return convert.prefill_result_to_proto(result)

    async def _run(self, engine_request: Request, context: grpc.aio.ServicerContext):
        try:
            stream = self.pod.submit(engine_request)
        except PodOverloaded as exc:
            self.metrics.record_outcome("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        tokens, final = [], None
        try:
            async for output in stream:
                tokens.extend(output.new_token_ids)
                final = output
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if final is None or not final.finished:
                # Cancelled (client gone, deadline): the engine frees the request's blocks.
                self.pod.loop.abort(engine_request.request_id)
                self.metrics.record_outcome("cancelled")
        if final is None:
            await context.abort(grpc.StatusCode.ABORTED, "the request was aborted before token 1")
        return final, tokens

    def _result(self, work: convert.PrefillInput, run) -> convert.PrefillResult:
        final, tokens = run
        if final.finish_reason is FinishReason.ERROR or not tokens:
            raise RuntimeError(f"prefill of {work.request_id} ended with {final.finish_reason} and no token")
        token_id = tokens[0]
        handle = (final.kv_transfer_params or {}).get(REMOTE_HANDLE)
        num_prompt = len(work.prompt_token_ids)
        reason = first_token_finish_reason(
            token_id, work.sampling, self.pod.eos_token_id, num_prompt, self.pod.max_model_len
        )
        if reason is not None or handle is None:
            if handle is not None:
                self.pod.connector.release(work.request_id, handle.engine_id)  # nobody will pull it
            return convert.PrefillResult(token_id, num_prompt, finish_reason=reason or final.finish_reason)
        return convert.PrefillResult(token_id, num_prompt, handle=handle)

    async def GetKvSource(self, request, context):
        await self.require_pod(context)
        return convert.kv_source_to_proto(self.pod.kv_source())

    async def ReleaseKv(self, request: prefill_pb2.ReleaseKvRequest, context):
        await self.require_pod(context)
        intact = self.pod.connector.release(request.request_id, request.engine_id)
        return prefill_pb2.ReleaseKvResponse(intact=intact)

    async def GetLoad(self, request, context):
        await self.require_pod(context)
        return common_pb2.GetLoadResponse(
            load=convert.load_report_to_proto(self.pod.load_report()), engine_id=self.pod.engine_id
        )
