"""The mapping of generate.proto: the public Generate request and response."""
from __future__ import annotations

from proto.pdserve.v1 import generate_pb2
from shared.serving.generation import GenerateChunk, GenerateInput, check_request_id
from shared.serving.wire.common import (
    finish_reason_from_proto, finish_reason_to_proto, sampling_params_from_proto, token_logprobs_from_proto,
    token_logprobs_to_proto, token_ids_from_proto,
)


def generate_prompt_from_proto(message: generate_pb2.GenerateRequest) -> str | list[int]:
    """The prompt as text or token ids; ValueError when absent or empty."""
    kind = message.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is missing: set text or token_ids")
    if kind == "text":
        if not message.text:
            raise ValueError("prompt text is empty")
        return message.text
    return token_ids_from_proto(message.token_ids.ids, name="prompt token_ids")


def generate_input_from_proto(message: generate_pb2.GenerateRequest, timeout_s: float | None) -> GenerateInput:
    """The domain request of a Generate call (timeout_s: the call's deadline); ValueError saying what is wrong."""
    check_request_id(message.request_id)
    prompt = generate_prompt_from_proto(message)
    sampling = sampling_params_from_proto(message.sampling if message.HasField("sampling") else None)
    return GenerateInput(prompt, sampling, message.request_id, timeout_s)


def generate_chunk_to_proto(chunk: GenerateChunk) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
        num_prompt_tokens=chunk.num_prompt_tokens,
        num_output_tokens=chunk.num_output_tokens,
        logprobs=[token_logprobs_to_proto(entry) for entry in chunk.logprobs],
        index=chunk.index,
        stop_string=chunk.stop_string,
        prompt_logprobs=[token_logprobs_to_proto(entry) for entry in chunk.prompt_logprobs],
    )


def generate_chunk_from_proto(message: generate_pb2.GenerateResponse) -> GenerateChunk:
    return GenerateChunk(
        request_id=message.request_id,
        token_ids=list(message.token_ids),
        text=message.text,
        finish_reason=finish_reason_from_proto(message.finish_reason),
        num_prompt_tokens=message.num_prompt_tokens,
        num_output_tokens=message.num_output_tokens,
        logprobs=[token_logprobs_from_proto(entry) for entry in message.logprobs],
        index=message.index,
        stop_string=message.stop_string,
        prompt_logprobs=[token_logprobs_from_proto(entry) for entry in message.prompt_logprobs],
    )
