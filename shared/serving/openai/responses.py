"""/v1/responses: OpenAI's Responses API served over the chat path (the translation is in
responses_protocol): a Response object, or Responses stream events."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from shared.serving.generation import GenerateChunk, GenerateInput
from shared.serving.openai import responses_protocol
from shared.serving.openai.chat import chat_inputs
from shared.serving.openai.choices import Choices, ParsedRequest
from shared.serving.openai.serve import serve
from shared.serving.openai.state import FrontState
from shared.serving.openai.streaming import EVENT_STREAM, collect, response_events


async def responses(state: FrontState, request: Request) -> Response:
    return await serve(state, request, is_chat=True, parse=_inputs, answer=_answer)


def _inputs(state: FrontState, body: dict[str, Any]) -> tuple[list[GenerateInput], ParsedRequest]:
    return chat_inputs(state, responses_protocol.chat_body(body))


async def _answer(state: FrontState, request: Request, body: dict[str, Any], parsed: ParsedRequest,
                  choices: Choices, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk]) -> Response:
    """The chat answer as a Response object, or as Responses stream events."""
    shell = responses_protocol.ResponseShell(body, state.model_name)
    if parsed.options.is_streaming:
        events = response_events(responses_protocol.ResponseEvents(shell), choices, first, chunks)
        return StreamingResponse(events, media_type=EVENT_STREAM)
    if (failed := await collect(request, choices, first, chunks)) is not None:
        return failed
    whole = choices.whole()
    [choice] = whole["choices"]
    output = responses_protocol.output_items(choice["message"], choice.get("logprobs"))
    return JSONResponse(shell.response("completed", output, whole["usage"], choice["finish_reason"]))
