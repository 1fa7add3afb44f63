"""GenerateService on one colocated pod: the router's public API (same validation, streaming and
statuses) with prefill and decode run by a single engine, no KV handoff."""
from __future__ import annotations

import logging
import time
import uuid

import grpc
from opentelemetry import trace

from proto.pdserve.v1 import generate_pb2_grpc
from shared.serving import convert
from shared.serving.metrics import ServiceMetrics
from shared.serving.pod_server import ADMISSION_ERRORS, STREAM_ERRORS, PodServicer, admission_status, stream_status
from shared.engine.request import FinishReason, Request, SamplingParams
from shared.serving.telemetry import SpanAttr
from shared.serving.text import TextStream

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The call's input is unusable; the message says why (-> INVALID_ARGUMENT)."""


class ColocatedServicer(PodServicer, generate_pb2_grpc.GenerateServiceServicer):
    """Runs whole requests on the attached pod (role None)."""

    def __init__(self, metrics: ServiceMetrics, tokenizer=None):
        """tokenizer: a tokenizers.Tokenizer for text prompts; the model's own is used when None."""
        super().__init__()
        self.metrics = metrics
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        return self.pod.tokenizer if self.pod is not None else None

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        pod = await self.admit(context)
        started = time.monotonic()
        parent = self.trace_parent()
        span = trace.get_current_span()
        request_id = request.request_id or uuid.uuid4().hex
        # Two clients may choose the same id; the engine keys requests by id, so make it unique.
        engine_request_id = f"{request_id}.{uuid.uuid4().hex[:8]}" if request.request_id else request_id
        span.set_attribute(SpanAttr.REQUEST_ID, request_id)
        outcome = "cancelled"  # the caller went away, unless something below decides otherwise
        stream = None
        finish: FinishReason | None = None
        num_output = 0
        first_token_at = None
        try:
            try:
                prompt_ids, sampling = self.validate(request)
            except InvalidRequest as exc:
                outcome = "invalid"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            span.set_attribute(SpanAttr.NUM_PROMPT_TOKENS, len(prompt_ids))
            try:
                stream = pod.submit(Request(engine_request_id, prompt_ids, sampling, eos_token_id=pod.eos_token_id))
            except ADMISSION_ERRORS as exc:
                code, outcome = admission_status(exc)
                await context.abort(code, str(exc))
            text = TextStream(self.tokenizer) if self.tokenizer is not None else None
            try:
                async for outputs in stream.batches():
                    token_ids = [t for output in outputs for t in output.new_token_ids]
                    finish = outputs[-1].finish_reason if outputs[-1].finished else None
                    if not token_ids and finish is None:
                        continue
                    num_output += len(token_ids)
                    if token_ids and first_token_at is None:
                        first_token_at = time.monotonic()
                        self.metrics.ttft_seconds.observe(first_token_at - started)
                        span.set_attribute(SpanAttr.TTFT_S, first_token_at - started)
                    if finish is not None:
                        # Settled before the last message goes out: a caller may hang up once it has it.
                        outcome = "error" if finish is FinishReason.ERROR else "ok"
                        self.record_finish(span, num_output, finish, first_token_at)
                    yield convert.generate_chunk_to_proto(
                        request_id=request_id,
                        token_ids=token_ids,
                        text=text.push(token_ids, final=finish is not None) if text is not None else "",
                        finish_reason=finish,
                        num_prompt_tokens=len(prompt_ids),
                        num_output_tokens=num_output,
                    )
            except STREAM_ERRORS as exc:
                code, outcome = stream_status(exc)
                await context.abort(code, str(exc))
            if finish is None:  # the stream ended unfinished: the pod aborted everything (shutdown)
                outcome = "error"
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the pod stopped before the request finished")
        finally:
            if stream is not None and finish is None:
                pod.loop.abort(engine_request_id)  # cancelled, deadline or error: frees the request's blocks
            self.metrics.record_outcome(outcome)
            if stream is not None:
                self.record_stage_spans("colocated", parent, stream.timeline, {SpanAttr.REQUEST_ID: request_id})


    def validate(self, request) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling params, or InvalidRequest saying what is wrong."""
        try:
            prompt = convert.generate_prompt_from_proto(request)
            sampling = convert.sampling_params_from_proto(request.sampling if request.HasField("sampling") else None)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(
                    "text prompts need a tokenizer: serve a model directory with tokenizer.json "
                    "(or pass --tokenizer), or send token_ids"
                )
            prompt = list(self.tokenizer.encode(prompt).ids)
            if not prompt:
                raise InvalidRequest("prompt text encodes to no tokens")
        try:
            prompt = convert.token_ids_from_proto(prompt, name="prompt token_ids", vocab_size=self.pod.vocab_size)
            self.pod.check_prompt_fits(len(prompt))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return prompt, sampling
