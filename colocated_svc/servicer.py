"""GenerateService on one colocated pod: the router's public API (same validation, streaming and
statuses) with prefill and decode run by a single engine, no KV handoff."""
from __future__ import annotations

import functools
import logging
import uuid
from typing import AsyncIterator

import grpc

from proto.pdserve.v1 import generate_pb2_grpc
from shared.serving import fan_out
from shared.serving.wire.common import token_ids_from_proto
from shared.serving.generate_rpc import serve_generate
from shared.serving.generation import GenerateChunk, GenerateInput, OnEnd, prompt_token_ids
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.outcomes import CallError, InvalidRequest, PodUnavailable, invalid_on_value_error
from shared.serving.pod.servicer import PodServicer
from shared.engine.request import FinishReason, Request, SamplingParams
from shared.serving.output_text import OutputText
from shared.serving.server.telemetry import SpanAttr
from shared.serving.text import TextStream, encode_text

logger = logging.getLogger(__name__)


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
        """The gRPC call: a proto adapter over generate()."""
        async for message in serve_generate(self.generate, request, context):
            yield message

    async def generate(self, work: GenerateInput, *, on_end: OnEnd | None = None) -> AsyncIterator[GenerateChunk]:
        """One request's chunks (n completions interleaved, labelled by index); CallEnded with its status
        when it fails. on_end: unused (closing the generator ends the engine request)."""
        request_id = work.request_id or uuid.uuid4().hex
        sampling = work.sampling
        if sampling.n == 1:
            async for chunk in self._complete(work, request_id, sampling, 0):
                yield chunk
            return
        try:
            self.admitted_pod().check_room(sampling.n)  # the completions run together or not at all
        except CallError as exc:
            raise self.refused(exc) from None
        children = lambda index: self._complete(  # noqa: E731
            work, request_id, fan_out.child_params(sampling, index), index
        )
        async for chunk in fan_out.merge(children, sampling.n):
            yield chunk

    async def _complete(self, work: GenerateInput, request_id: str, sampling: SamplingParams,
                        index: int) -> AsyncIterator[GenerateChunk]:
        """One completion of the request, its chunks labelled with index."""
        async with self.start_local_call("colocated") as call:
            pod = self.pod
            call.request_id = request_id
            # Two clients may choose the same id; the engine keys requests by id, so make it unique.
            engine_request_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
            call.span.set_attribute(SpanAttr.REQUEST_ID, request_id)
            prompt_ids, _ = await self.validate(work, sampling)
            with invalid_on_value_error():
                output = OutputText(TextStream(self.tokenizer) if self.tokenizer is not None else None, sampling)
            call.span.set_attribute(SpanAttr.NUM_PROMPT_TOKENS, len(prompt_ids))
            stream = call.submit(Request(engine_request_id, prompt_ids, sampling, eos_token_id=pod.eos_token_id))
            finish = None
            prompt_logprobs = []  # they come with the prompt's chunks; they go out with token 1
            async for outputs in stream.batches():
                token_ids = [t for output_ in outputs for t in output_.new_token_ids]
                logprobs = [e for output_ in outputs for e in (output_.new_logprobs or ())]
                prompt_logprobs.extend(e for output_ in outputs for e in (output_.new_prompt_logprobs or ()))
                finish = outputs[-1].finish_reason if outputs[-1].finished else None
                if outputs[-1].error is not None:
                    raise InvalidRequest(outputs[-1].error)
                if not token_ids and finish is None:
                    continue
                delta = output.push(token_ids, finish)
                call.count_tokens(len(delta.token_ids))
                if delta.stop_string is not None:
                    finish = FinishReason.STOP
                    call.stop_early(finish)
                elif finish is not None:
                    call.finish(finish)
                yield GenerateChunk(
                    request_id=request_id,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    finish_reason=finish,
                    num_prompt_tokens=len(prompt_ids),
                    num_output_tokens=call.num_output_tokens,
                    logprobs=logprobs[:len(delta.token_ids)],
                    index=index,
                    stop_string=delta.stop_string or "",
                    prompt_logprobs=prompt_logprobs,
                )
                prompt_logprobs = []
                if finish is not None:
                    return
            if finish is None:  # the stream ended unfinished: the pod aborted everything (shutdown)
                raise PodUnavailable("the pod stopped before the request finished")

    async def validate(self, work: GenerateInput, sampling: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling params the pod resolved, or InvalidRequest saying what is
        wrong."""
        tokenizer = self.tokenizer
        encode = functools.partial(encode_text, tokenizer) if tokenizer is not None else None
        with invalid_on_value_error():
            prompt = await prompt_token_ids(
                work, encode, no_tokenizer_hint="serve a model directory with tokenizer.json (or pass --tokenizer)"
            )
            prompt = token_ids_from_proto(prompt, name="prompt token_ids", vocab_size=self.pod.vocab_size)
            self.pod.check_context_length(sampling, len(prompt))
            sampling = self.pod.fill_sampling(sampling, len(prompt))
        return prompt, sampling
