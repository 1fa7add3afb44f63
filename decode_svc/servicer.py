"""DecodeService: continues a request from its prompt and token 1, pulling the prompt's KV from the
prefill pod over NIXL (or recomputing it), and streams every token ready since the last message."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from proto.pdserve.v1 import common_pb2, decode_pb2_grpc
from shared import convert
from shared.engine_loop import EngineStopped
from shared.kv_transfer.handle import KvPullOutcome, KvPullStats
from shared.kv_transfer.nixl import REMOTE_HANDLE, REMOTE_SOURCE
from shared.metrics import ServiceMetrics
from shared.pod import PodOverloaded
from shared.pod_main import PodServicer
from shared.request import Request

from decode_svc.kv_sources import KvSourceCache, KvSourceUnavailable

logger = logging.getLogger(__name__)


class DecodeServicer(PodServicer, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, metrics: ServiceMetrics, sources: KvSourceCache):
        super().__init__()
        self.metrics = metrics
        self.sources = sources

    def attach(self, pod) -> None:
        super().attach(pod)
        # The connector confirms each pull with ReleaseKv: it asks from the engine thread, the
        # call runs on this event loop, and the answer goes back to the connector.
        loop = asyncio.get_running_loop()
        pod.connector.release_remote = lambda handle, request_id: self.sources.release_from_engine_thread(
            loop, handle, request_id
        )
        self.sources.on_release_result = pod.connector.on_release_result

    async def Decode(self, request, context: grpc.aio.ServicerContext):
        await self.require_pod(context)
        started = time.monotonic()
        try:
            work = convert.decode_request_from_proto(request, vocab_size=self.pod.vocab_size)
            self.pod.check_prompt_fits(len(work.prompt_token_ids) + len(work.generated_token_ids))
        except ValueError as exc:
            self.metrics.record_outcome("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine_request, early_stats = await self._engine_request(work)
        try:
            stream = self.pod.submit(engine_request)
        except PodOverloaded as exc:
            self.metrics.record_outcome("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finished = False
        is_first = True
        num_tokens = 0
        first_token_at = None
        try:
            async for outputs in stream.batches():
                token_ids = [t for output in outputs for t in output.new_token_ids]
                finish_reason = outputs[-1].finish_reason
                finished = finish_reason is not None
                chunk = convert.DecodeChunk(token_ids=token_ids, finish_reason=finish_reason)
                if is_first:
                    stats = self.pod.connector.pop_pull_stats(work.request_id) or early_stats
                    self.metrics.record_transfer(stats.num_bytes, stats.seconds)
                    chunk = dataclasses.replace(chunk, kv_pull=stats)
                    is_first = False
                if token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
                    self.metrics.ttft_seconds.observe(first_token_at - started)
                num_tokens += len(token_ids)
                yield convert.decode_chunk_to_proto(chunk)
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not finished:
                self.pod.loop.abort(work.request_id)  # cancelled: frees blocks (after any READ in flight)
                self.metrics.record_outcome("cancelled")
        self.metrics.record_outcome("ok")
        if num_tokens > 1:
            self.metrics.tpot_seconds.observe((time.monotonic() - first_token_at) / (num_tokens - 1))

    async def _engine_request(self, work: convert.DecodeInput) -> tuple[Request, KvPullStats]:
        """The engine request continuing prompt + generated, with the handle if it can be pulled from."""
        remaining = work.sampling.max_tokens - len(work.generated_token_ids)
        params = dataclasses.replace(work.sampling, max_tokens=remaining)
        kv_params = None
        stats = KvPullStats(0, 0, 0, 0.0, KvPullOutcome.NO_HANDLE)
        if work.handle is not None:
            try:
                source = await self.sources.get(work.handle)
                kv_params = {REMOTE_HANDLE: work.handle, REMOTE_SOURCE: source}
            except KvSourceUnavailable as exc:
                logger.warning("cannot pull %s, recomputing: %s", work.request_id, exc)
                stats = KvPullStats(0, 0, 0, 0.0, KvPullOutcome.RECOMPUTED_ERROR)
                self.sources.release_quietly(work.handle, work.request_id)
        engine_request = Request(
            work.request_id,
            work.prompt_token_ids + work.generated_token_ids,
            params,
            eos_token_id=self.pod.eos_token_id,
            kv_transfer_params=kv_params,
        )
        return engine_request, stats

    async def GetLoad(self, request, context):
        await self.require_pod(context)
        return common_pb2.GetLoadResponse(
            load=convert.load_report_to_proto(self.pod.load_report()), engine_id=self.pod.engine_id
        )
