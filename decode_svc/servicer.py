"""DecodeService: continues a request from its prompt and token 1, pulling the prompt's KV from the
prefill pod over NIXL (or recomputing it), and streams every token ready since the last message.
Traces each call (kv-pull, decode-queue, decode) and counts it by outcome."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from shared.serving.wire.common import load_report_to_proto
from shared.serving.wire.decode import check_not_past_max_tokens, decode_chunk_to_proto, decode_request_from_proto
from shared.serving.wire import payloads as wire
from shared.serving.pod.engine_thread import RequestStream
from shared.serving.pod.outcomes import (
    HandleNotAuthentic, InvalidRequest, KvUnusable, PodUnavailable, invalid_on_value_error,
)
from shared.engine.kv_cache.hashing import prompt_digest
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy
from shared.engine.kv_transfer.handle import KvHandleNotAuthentic, KvHandleOtherPrompt, KvPullOutcome, KvPullStats
from shared.engine.kv_transfer.handoff import PullFromPeer
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.call import PodCall
from shared.serving.pod.servicer import PodServicer
from shared.engine.request import FinishReason, Request
from shared.serving.server.telemetry import SpanAttr

from decode_svc.kv_sources import KvSourceCache, KvSourceUnavailable
from decode_svc.transport_probe import TRANSPORT_NAMES

logger = logging.getLogger(__name__)

# kv-pull outcome of a pull the request's end cut short.
PULL_ABORTED = "aborted"
# Requests that ended mid-pull still confirm the pull (ReleaseKv) later; their trace context waits
# here for that call, bounded in case a confirmation never comes.
MAX_LATE_RELEASES = 1024
# Distinct prefill engines whose handles failed to verify that are named in the log (forged ids are endless).
MAX_UNVERIFIED_ENGINES_LOGGED = 64


@dataclass
class _DecodeTrace:
    """One traced Decode call: the parent of its spans, and the kv-pull span once a pull is under way
    (started when the ReleaseKv confirmation goes out, so that call nests under it)."""

    parent: otel_context.Context
    stream: RequestStream | None = None
    pull_span: trace.Span | None = None


class DecodeServicer(PodServicer, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, metrics: ServiceMetrics, sources: KvSourceCache):
        super().__init__()
        self.metrics = metrics
        self.sources = sources
        sources.on_probe_failure = lambda result: metrics.kv_transport_failures.labels(result.transport).inc()
        for transport in TRANSPORT_NAMES:  # a series per transport from the start: alerts see 0, not "no data"
            metrics.kv_transport_failures.labels(transport)
        self._traces: dict[str, _DecodeTrace] = {}
        self._late_releases: dict[str, otel_context.Context] = {}
        self._unverified_engines: set[str] = set()  # prefill engines whose handles failed to verify (logged)

    def use_tracing(self, tracing) -> None:
        super().use_tracing(tracing)
        # GetKvSource and ReleaseKv continue the request's trace.
        self.sources.use_interceptors(tracing.client_interceptors())
        if tracing.is_enabled:
            self.sources.release_context = self._release_context

    def attach(self, pod) -> None:
        super().attach(pod)
        self.sources.open_probe()

    async def close(self) -> None:
        await self.sources.close()

    async def Decode(self, request, context: grpc.aio.ServicerContext):
        async with await self.start_call(context, None) as call:
            with invalid_on_value_error():
                work = decode_request_from_proto(request, vocab_size=self.pod.vocab_size)
                # Generated tokens count against max_tokens, so prompt + max_tokens bounds the whole sequence.
                sampling = self.pod.fill_sampling(work.sampling, len(work.prompt_token_ids))
                work = dataclasses.replace(work, sampling=sampling)
                check_not_past_max_tokens(work.generated_token_ids, work.sampling)
            call.span.set_attribute(SpanAttr.REQUEST_ID, work.request_id)
            call.span.set_attribute(SpanAttr.NUM_PROMPT_TOKENS, len(work.prompt_token_ids))
            if len(work.generated_token_ids) == work.sampling.max_tokens:
                yield self._already_complete(work, call)
                return
            traced = None
            if call.parent is not None and work.request_id not in self._traces:
                traced = self._traces[work.request_id] = _DecodeTrace(call.parent)
            finish_reason = None
            try:
                engine_request, early_stats = await self._engine_request(work)
                stream = call.submit(engine_request)
                if traced is not None:
                    traced.stream = stream
                pull_stats = kv_pull = None
                prompt_logprobs = []  # they come with the prompt's chunks; they go out with the first token
                async for outputs in stream.batches():
                    token_ids = [t for output in outputs for t in output.new_token_ids]
                    logprobs = [e for output in outputs for e in (output.new_logprobs or ())]
                    prompt_logprobs.extend(e for output in outputs for e in (output.new_prompt_logprobs or ()))
                    finish_reason = outputs[-1].finish_reason
                    kv_pull = next((output.kv_pull for output in outputs if output.kv_pull is not None), kv_pull)
                    if not token_ids and finish_reason is None:
                        continue  # a prompt chunk's logprobs alone
                    chunk = wire.DecodeChunk(token_ids=token_ids, finish_reason=finish_reason, logprobs=logprobs,
                                             prompt_logprobs=prompt_logprobs)
                    prompt_logprobs = []
                    if pull_stats is None:
                        pull_stats = self._report_pull(work, kv_pull or early_stats)
                        chunk = dataclasses.replace(chunk, kv_pull=pull_stats)
                    call.count_tokens(len(token_ids))
                    if outputs[-1].error is not None:
                        raise InvalidRequest(outputs[-1].error)
                    if finish_reason is FinishReason.ERROR:
                        # Otherwise only the kv-load-failure policy "fail" ends a decode this way: say so.
                        raise KvUnusable(self._failure_message(work.request_id, pull_stats))
                    if finish_reason is not None:
                        call.finish(finish_reason)
                    yield decode_chunk_to_proto(chunk)
                if finish_reason is None:
                    raise PodUnavailable("the pod stopped before the request finished")
            finally:
                if traced is not None:
                    self._end_trace(work.request_id, traced, call.num_output_tokens, finish_reason)

    def _already_complete(self, work: wire.DecodeInput, call: PodCall) -> decode_pb2.DecodeResponse:
        """The answer to a continuation whose generated tokens already reach max_tokens (a re-issue after a
        pod died right after the last token, before saying so): nothing to decode, the request ended for
        its length. A handle it carries is released once proved authentic (a forged one never is)."""
        if work.handle is not None:
            self._checked_prompt_digest(work)
            self.sources.release_quietly(work.handle, work.request_id)
        call.finish(FinishReason.LENGTH)
        return decode_chunk_to_proto(wire.DecodeChunk(finish_reason=FinishReason.LENGTH))

    def _report_pull(self, work: wire.DecodeInput, stats: KvPullStats) -> KvPullStats:
        """The pull's statistics (from the engine's output, or decided before the engine), once the first output
        is ready: metrics (by UCX transport) and the kv-pull span."""
        connector = self.pod.connector
        self.metrics.catch_up_kv_reads(connector.num_reads, connector.num_read_bytes)
        self.metrics.kv_transfer_seconds.inc(stats.seconds)
        transport = self.sources.transport_of(work.handle) if work.handle is not None else None
        if transport is not None:
            self.metrics.kv_pulls.labels(transport, stats.outcome.value).inc()
        self._end_pull_span(work.request_id, stats, transport)
        return stats

    def _failure_message(self, request_id: str, stats: KvPullStats | None) -> str:
        outcome = stats.outcome.value if stats is not None else "unknown"
        return (
            f"request {request_id}: the prompt's KV could not be used (pull outcome: {outcome}) and this decode "
            f"pod's kv-load-failure policy is '{self.pod.config.kv_load_failure_policy.value}'"
        )

    async def _engine_request(self, work: wire.DecodeInput) -> tuple[Request, KvPullStats]:
        """The engine request continuing prompt + generated, with the handle if it can be pulled from."""
        num_generated = len(work.generated_token_ids)
        params = dataclasses.replace(
            work.sampling,
            max_tokens=work.sampling.max_tokens - num_generated,
            min_tokens=max(0, work.sampling.min_tokens - num_generated),
        )
        kv_params = None
        stats = KvPullStats(0, 0, 0, 0.0, KvPullOutcome.NO_HANDLE)
        if work.handle is not None:
            digest = self._checked_prompt_digest(work)
            unusable = self.pod.connector.pull_precheck(work.handle)
            if unusable is not None:
                # Nothing will be read: end the prefill pod's hold now, not at its lease's end.
                self.sources.release_quietly(work.handle, work.request_id)
            else:
                kv_params, unusable = await self._reserved_pull(work, digest)
            if unusable is not None:
                stats = KvPullStats(0, 0, 0, 0.0, unusable)
                if self.pod.config.kv_load_failure_policy is KVLoadFailurePolicy.FAIL:
                    raise KvUnusable(self._failure_message(work.request_id, stats))
        engine_request = Request(
            work.request_id,
            work.prompt_token_ids + work.generated_token_ids,
            params,
            eos_token_id=self.pod.eos_token_id,
            kv_transfer_params=kv_params,
            # Penalties and a grammar see the generated tokens as output, as the colocated engine does.
            num_prior_output_tokens=num_generated,
        )
        return engine_request, stats

    async def _reserved_pull(self, work: wire.DecodeInput, digest: bytes) -> tuple[PullFromPeer | None, KvPullOutcome | None]:
        """The pull of the handle once its prefill pod reserved the hold for this request (a handle is READ
        once, and only while its hold stands: a replayed one reads nothing), else why the prompt is recomputed.
        The reservation runs alongside the source look-up, so it adds no round trip of its own to a request."""
        handle = work.handle
        source, reserved = await asyncio.gather(
            self.sources.get(handle), self.sources.reserve(handle, work.request_id, digest), return_exceptions=True
        )
        if reserved is False:
            # The hold ended (released, abandoned, expired) or another pull has it: nothing of it is ours to end.
            logger.info("request %s: prefill pod %s did not reserve the hold (gone or already pulled); recomputing",
                        work.request_id, handle.source_address)
            return None, KvPullOutcome.RECOMPUTED_LEASE_EXPIRED
        for failure in (source, reserved):
            if isinstance(failure, KvSourceUnavailable):
                logger.warning("cannot pull %s: %s", work.request_id, failure)
                # Nothing will be read: end the prefill pod's hold now, not at its lease's end.
                self.sources.release_quietly(handle, work.request_id)
                return None, KvPullOutcome.RECOMPUTED_ERROR
            if isinstance(failure, BaseException):
                raise failure
        return PullFromPeer(handle, source, digest), None

    def _warn_unverified(self, engine_id: str, source_address: str) -> None:
        """Once per engine (bounded): every handle of a prefill pod run with another key fails, and the
        clients alone would see it."""
        if engine_id in self._unverified_engines or len(self._unverified_engines) >= MAX_UNVERIFIED_ENGINES_LOGGED:
            return
        self._unverified_engines.add(engine_id)
        logger.warning("a KV handle naming prefill engine %s at %s does not verify under this pod's key: the "
                       "prefill and decode pods were given different --kv-handle-key-file / PDSERVE_KV_HANDLE_KEY, "
                       "or the handle was forged; such requests fail with PERMISSION_DENIED", engine_id, source_address)

    def _checked_prompt_digest(self, work: wire.DecodeInput) -> bytes:
        """The request's own prompt digest, once the handle proved authentic and made for that prompt.
        A refused handle is not released: whoever holds the real one may still pull with it."""
        digest = prompt_digest(work.prompt_token_ids, work.handle.block_size)
        try:
            self.pod.connector.check_handle(work.handle, digest)
        except KvHandleNotAuthentic as exc:
            self._warn_unverified(work.handle.engine_id, work.handle.source_address)
            raise HandleNotAuthentic(f"request {work.request_id}: {exc}") from None
        except KvHandleOtherPrompt as exc:
            raise InvalidRequest(f"request {work.request_id}: {exc}") from None
        return digest

    # ---- spans ---------------------------------------------------------------------------------
    def _release_context(self, request_id: str) -> otel_context.Context | None:
        """The context a ReleaseKv call for request_id runs in: under the request's kv-pull span."""
        traced = self._traces.get(request_id)
        if traced is None:
            return self._late_releases.pop(request_id, None)
        if traced.pull_span is None:
            timeline = traced.stream.timeline if traced.stream is not None else None
            start_ns = (timeline.kv_wait_started_ns or timeline.scheduled_ns) if timeline is not None else None
            traced.pull_span = self.tracing.tracer.start_span(
                "kv-pull", context=traced.parent, start_time=start_ns or time.time_ns(),
                attributes={SpanAttr.REQUEST_ID: request_id},
            )
        return trace.set_span_in_context(traced.pull_span, traced.parent)

    def _end_pull_span(self, request_id: str, stats: KvPullStats, transport: str | None) -> None:
        traced = self._traces.get(request_id)
        if traced is None:
            return
        timeline = traced.stream.timeline if traced.stream is not None else None
        end_ns = (timeline.computing_ns if timeline is not None else None) or time.time_ns()
        attributes = {
            SpanAttr.REQUEST_ID: request_id,
            SpanAttr.KV_BYTES: stats.num_bytes,
            SpanAttr.KV_BLOCKS: stats.num_blocks,
            "pdserve.kv.num_cached_blocks": stats.num_cached_blocks,
            "pdserve.kv.seconds": stats.seconds,
            SpanAttr.KV_GBPS: stats.num_bytes / stats.seconds / 1e9 if stats.seconds > 0 else 0.0,
            SpanAttr.KV_OUTCOME: stats.outcome.value,
        }
        if transport is not None:
            attributes[SpanAttr.KV_TRANSPORT] = transport
        if traced.pull_span is None:
            if stats.outcome is KvPullOutcome.NO_HANDLE:
                return
            start_ns = (timeline.kv_wait_started_ns or timeline.scheduled_ns) if timeline is not None else None
            self.record_span("kv-pull", traced.parent, start_ns or end_ns, end_ns, attributes)
            return
        span, traced.pull_span = traced.pull_span, None
        span.set_attributes(attributes)
        span.end(end_time=max(end_ns, span.start_time or 0))

    def _end_trace(self, request_id: str, traced: _DecodeTrace, num_tokens: int, reason: FinishReason | None) -> None:
        del self._traces[request_id]
        if traced.pull_span is not None:  # the request ended before its pull did
            traced.pull_span.set_attribute(SpanAttr.KV_OUTCOME, PULL_ABORTED)
            traced.pull_span.end()
            if len(self._late_releases) >= MAX_LATE_RELEASES:
                del self._late_releases[next(iter(self._late_releases))]
            self._late_releases[request_id] = trace.set_span_in_context(traced.pull_span, traced.parent)
        if traced.stream is not None:
            attributes = {SpanAttr.REQUEST_ID: request_id, SpanAttr.NUM_OUTPUT_TOKENS: num_tokens}
            if reason is not None:
                attributes[SpanAttr.FINISH_REASON] = reason.value
            self.record_stage_spans("decode", traced.parent, traced.stream.timeline, attributes)

    async def GetLoad(self, request, context):
        await self.require_pod(context)
        return common_pb2.GetLoadResponse(
            load=load_report_to_proto(self.pod.load_report()), engine_id=self.pod.engine_id
        )
