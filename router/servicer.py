"""The public Generate call: validate, prefill on one pod (token 1 streamed at once), decode on another,
relay tokens. The legs live in prefill_leg.py and decode_leg.py; what they share in route_call.py."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from proto.pdserve.v1 import generate_pb2_grpc
from router.decode_leg import DecodeLeg
from router.flags import RouterConfig
from router.kv_index import KvIndex, PromptHashes
from router.metrics import RouterMetrics
from router.picking import Picker, no_pick_error
from router.policy import Route, candidates
from router.prefill_leg import PrefillLeg
from router.route_call import Deadline, Hold, HoldReleases, RouteError
from router.workers import WorkerPool
from shared.engine.request import FinishReason, SamplingParams
from shared.serving import fan_out
from shared.serving.generate_rpc import serve_generate
from shared.serving.generation import CallEnded, GenerateChunk, GenerateInput, OnEnd, prompt_token_ids
from shared.serving.pod.outcomes import (
    CANCELLED, ERROR, INVALID, OK, InvalidRequest, check_context_length, outcome_of_code,
)
from shared.serving.output_text import OutputText
from shared.serving.text import TextCodec

logger = logging.getLogger(__name__)

# RouteError stays importable from here, where callers met it first.
__all__ = ["RouterServicer", "RouteError"]


class _Completion:
    """One completion's chunks as the client gets them: text decoded incrementally, stop strings cut, the
    output counted."""

    def __init__(self, request_id: str, num_prompt_tokens: int, index: int, output: OutputText):
        self._request_id = request_id
        self._num_prompt_tokens = num_prompt_tokens
        self._index = index
        self._output = output
        self._num_sent = 0

    def chunk(self, token_ids: list[int], finish: FinishReason | None, logprobs: list,
              prompt_logprobs: list) -> GenerateChunk:
        delta = self._output.push(token_ids, finish)
        self._num_sent += len(delta.token_ids)
        return GenerateChunk(
            request_id=self._request_id,
            token_ids=delta.token_ids,
            text=delta.text,
            finish_reason=FinishReason.STOP if delta.stop_string is not None else finish,
            num_prompt_tokens=self._num_prompt_tokens,
            num_output_tokens=self._num_sent,
            logprobs=logprobs[:len(delta.token_ids)],
            index=self._index,
            stop_string=delta.stop_string or "",
            prompt_logprobs=prompt_logprobs,
        )


def _no_cleanup(cleanup) -> None:
    """A caller whose call ends only by closing the generator (whose finally frees the hold)."""


class RouterServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        config: RouterConfig,
        codec: TextCodec | None = None,
        metrics: RouterMetrics | None = None,
        tracer: trace.Tracer | None = None,
        kv_index: KvIndex | None = None,
    ):
        self._prefill = prefill
        self._decode = decode
        self._config = config
        self._codec = codec
        self._metrics = metrics
        self._picker = Picker(config, tracer or trace.NoOpTracer(), kv_index, metrics, (prefill.tier, decode.tier))
        self._holds = HoldReleases(prefill)
        self._prefill_leg = PrefillLeg(prefill, decode, config, self._picker, self._holds, metrics)
        self._decode_leg = DecodeLeg(decode, config, self._picker, self._holds, metrics)

    # ---- the call ------------------------------------------------------------------------------
    async def Generate(self, request, context):
        """The gRPC call: a proto adapter over generate()."""
        async for message in serve_generate(self.generate, request, context, on_invalid=self._count_invalid):
            yield message

    async def generate(self, work: GenerateInput, *, on_end: OnEnd | None = None) -> AsyncIterator[GenerateChunk]:
        """One request's chunks (n completions interleaved, labelled by index); CallEnded with its status
        when it fails. on_end: registers the cleanup of a KV hold for when the caller's call ends."""
        request_id = work.request_id or uuid.uuid4().hex
        # Pods key holds by request id, and two clients may pick the same one: suffix it downstream.
        pod_request_id = f"{request_id}.{uuid.uuid4().hex[:8]}" if work.request_id else request_id
        start = time.monotonic()
        on_end = on_end or _no_cleanup
        outcome = ERROR
        num_output_tokens = 0
        try:
            prompt_ids, sampling = await self._validate(work)
            # The server span (from the tracing interceptor or the HTTP front, when on) is current here.
            span = trace.get_current_span()
            span.set_attribute("pdserve.request_id", pod_request_id)
            span.set_attribute("pdserve.num_prompt_tokens", len(prompt_ids))
            if "max_tokens" not in sampling.unset:  # else the pods fill it from the checkpoint
                span.set_attribute("pdserve.max_tokens", sampling.max_tokens)
            if self._metrics is not None:
                self._metrics.prompt_tokens.observe(len(prompt_ids) * sampling.n)
            deadline = Deadline(self._config.request_timeout_s if work.timeout_s is None else work.timeout_s)
            if sampling.n == 1:
                completions = self._route(request_id, pod_request_id, prompt_ids, sampling, deadline, start, on_end)
            else:
                completions = fan_out.merge(lambda index: self._route(
                    request_id, f"{pod_request_id}-{index}", prompt_ids, fan_out.child_params(sampling, index),
                    deadline, start, on_end, index,
                ), sampling.n)
            async with aclosing(completions):
                async for chunk in completions:
                    num_output_tokens += len(chunk.token_ids)
                    yield chunk
            outcome = OK
        except RouteError as exc:
            outcome = outcome_of_code(exc.code)
            if exc.where is not None:
                logger.info("request %s ended with %s on %s: %s", request_id, exc.code.name, exc.where, exc.message)
            raise CallEnded(exc.code, exc.message, exc.trailing_metadata) from None
        except (asyncio.CancelledError, GeneratorExit):
            # A client that goes away while a chunk is being written leaves this generator to be closed
            # (GeneratorExit at its yield), not cancelled: a cancel all the same.
            outcome = CANCELLED
            raise
        finally:
            if self._metrics is not None:
                self._metrics.requests.labels(outcome=outcome).inc()
                self._metrics.output_tokens.observe(num_output_tokens)

    def _count_invalid(self) -> None:
        """A Generate message that is unusable as it stands (counted as generate() counts bad input)."""
        if self._metrics is not None:
            self._metrics.requests.labels(outcome=INVALID).inc()

    async def _validate(self, work: GenerateInput) -> tuple[list[int], SamplingParams]:
        encode = self._codec.encode if self._codec is not None else None
        sampling = work.sampling
        try:
            prompt_ids = await prompt_token_ids(work, encode, no_tokenizer_hint="start the router with --tokenizer")
            if sampling.stop and self._codec is None:
                raise ValueError("sampling: stop strings need a tokenizer: start the router with --tokenizer")
        except ValueError as exc:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        capacity = min((c for c in (self._prefill.capacity, self._decode.capacity) if c is not None), default=None)
        if capacity is not None and sampling.n > capacity:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, f"n is {sampling.n}, and the pods of a tier run at "
                             f"most {capacity} requests at once, all together (--max-requests-in-flight)")
        # The split system's one length check: the pods do not check again (their engines end a sequence at
        # the model's length).
        max_model_len = self.max_model_len
        if max_model_len is not None:
            try:
                check_context_length(len(prompt_ids), sampling, max_model_len)
            except InvalidRequest as exc:
                raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return prompt_ids, sampling

    @property
    def max_model_len(self) -> int | None:
        """The model length both tiers take, as their load reports say (None until they reported)."""
        lengths = [n for n in (self._prefill.max_model_len, self._decode.max_model_len) if n is not None]
        return min(lengths, default=None)

    async def _route(
        self, request_id, pod_request_id, prompt_ids, sampling, deadline, start, on_end: OnEnd, index=0
    ) -> AsyncIterator[GenerateChunk]:
        """One completion: prefill then decode (or decode alone); its chunks labelled with index."""
        prompt = PromptHashes(prompt_ids)
        generated: list[int] = []
        completion = _Completion(request_id, len(prompt_ids), index,
                                 OutputText(self._codec.stream() if self._codec is not None else None, sampling))
        # Token 1 must not go out for a request no decode pod can take: check before any prefill.
        self._require_decode_capacity()
        hold = None
        try:
            decode_address = None
            if self._picker.decide(prompt, self._prefill, self._decode).route is Route.SPLIT:
                result, prefill_address, decode_address = await self._prefill_leg.run(
                    pod_request_id, prompt, sampling, deadline)
                # Decode continues with the params prefill resolved (an older pod sends none: keep the request's).
                sampling = result.resolved_sampling or sampling
                generated.append(result.first_token_id)
                if result.hands_off:
                    hold = Hold(prefill_address, pod_request_id, result.handle)
                    # However the call ends (cancelled or timed out even while token 1 goes out), a
                    # hold no decode pod confirmed is released at once, not at the lease's end.
                    on_end(lambda hold=hold: self._holds.abandon(hold))
                # Token 1 goes out before any decode work: TTFT never waits for the KV transfer.
                first_logprobs = [result.first_token_logprobs] if result.first_token_logprobs is not None else []
                first = completion.chunk([result.first_token_id], result.finish_reason, first_logprobs,
                                         result.prompt_logprobs)
                yield first
                self._record_ttft(start)
                if first.finish_reason is not None:
                    return  # token 1 ended it (or a stop string in it): the finally frees any hold
            decoded_chunks = self._decode_leg.run(pod_request_id, prompt, sampling, generated, deadline, hold,
                                                  decode_address)
            async with aclosing(decoded_chunks):
                async for decoded in decoded_chunks:
                    is_first = hold is None and len(generated) == len(decoded.token_ids) and bool(decoded.token_ids)
                    sent = completion.chunk(decoded.token_ids, decoded.finish_reason, decoded.logprobs,
                                            decoded.prompt_logprobs)
                    yield sent
                    if is_first:
                        self._record_ttft(start)
                    if sent.finish_reason is not None:
                        # Maybe a stop string: closing the decode call aborts the request on the decode pod.
                        return
        finally:
            # No decode pod confirmed the pull: free the prefill hold now instead of at lease expiry.
            self._holds.abandon(hold)

    def _require_decode_capacity(self) -> None:
        """RouteError unless some decode pod is healthy and not overloaded."""
        _, reason = candidates(self._decode.views())
        if reason is not None:
            raise no_pick_error(self._decode, reason, None, [])

    def _record_ttft(self, start: float) -> None:
        ttft = time.monotonic() - start
        trace.get_current_span().set_attribute("pdserve.ttft_s", ttft)
        if self._metrics is not None:
            self._metrics.ttft_seconds.observe(ttft)

    async def drain(self) -> None:
        """Waits for pending hold releases (called at shutdown)."""
        await self._holds.drain()
