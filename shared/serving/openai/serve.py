"""One generation request answered, for every endpoint family: the body parsed (off the event loop) into
generation inputs, generate() called for each prompt, and the answer built from its chunks (an error
status while nothing went out yet)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from shared.serving import fan_out
from shared.serving.generation import CallEnded, Generate, GenerateChunk, GenerateInput
from shared.serving.openai.choices import Choices, ParsedRequest
from shared.serving.openai.errors import SERVER_ERROR, ended_error, error, invalid
from shared.serving.openai.state import FrontState
from shared.serving.openai.streaming import EVENT_STREAM, chunk_events, collect, unless_disconnected
from shared.serving.pod.outcomes import InvalidRequest, invalid_on_value_error

# An endpoint's reading of its body: the generation inputs (one per prompt) and what the answer needs.
Parse = Callable[[FrontState, dict[str, Any]], tuple[list[GenerateInput], ParsedRequest]]
# An endpoint's answer, from the first chunk on: (state, request, body, parsed, choices, first, chunks).
Answer = Callable[..., Awaitable[Response]]


async def serve(state: FrontState, request: Request, *, is_chat: bool, parse: Parse, answer: Answer) -> Response:
    """One generation request: its body parsed by parse, its chunks answered by answer."""
    body = await state.request_body(request)
    if isinstance(body, Response):
        return body
    try:
        # Chat rendering and tokenizing a large prompt take long: off the event loop.
        inputs, parsed = await asyncio.to_thread(_parsed, parse, state, body)
    except InvalidRequest as exc:
        return invalid(exc)
    codec = state.codec()
    choices = Choices(is_chat, state.model_name, parsed, state.token_texts,
                      codec.token_bytes if codec is not None else None)
    chunks = generations(state.generate, inputs, parsed.n).__aiter__()
    try:
        # Bad input ends the call before its first chunk: answer it with a status, not a stream.
        first = await unless_disconnected(request, anext(chunks))
    except CallEnded as exc:
        return ended_error(exc)
    except StopAsyncIteration:
        return error(*SERVER_ERROR, "the request ended without output")
    if first is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return await answer(state, request, body, parsed, choices, first, chunks)


def _parsed(parse: Parse, state: FrontState, body: dict[str, Any]) -> tuple[list[GenerateInput], ParsedRequest]:
    with invalid_on_value_error():  # a value out of a field's range, for one
        return parse(state, body)


async def plain_answer(state: FrontState, request: Request, body: dict[str, Any], parsed: ParsedRequest,
                       choices: Choices, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk]) -> Response:
    """Completions and chat: a stream of chunks, or the whole answer."""
    if parsed.options.is_streaming:
        return StreamingResponse(chunk_events(choices, parsed.options, first, chunks), media_type=EVENT_STREAM)
    failed = await collect(request, choices, first, chunks)
    return failed or JSONResponse(choices.whole())


def generations(generate: Generate, inputs: list[GenerateInput], n: int) -> AsyncIterator[GenerateChunk]:
    """The chunks of one generate() call per prompt, as they come; prompt i's completions are choices
    i*n .. i*n+n-1 (OpenAI's order for a batch of prompts)."""
    if len(inputs) == 1:
        return generate(inputs[0])

    async def one(prompt_index: int) -> AsyncIterator[GenerateChunk]:
        async for chunk in generate(inputs[prompt_index]):
            chunk.index += prompt_index * n
            yield chunk

    return fan_out.merge(one, len(inputs))
