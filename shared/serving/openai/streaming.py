"""Answers as they are read from a generation: server-sent events (chat and completions chunks, Responses
events), or every chunk collected for a whole answer; a client that hangs up cancels its request."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import Response

from shared.serving.generation import CallEnded, GenerateChunk
from shared.serving.openai.choices import Choices
from shared.serving.openai.errors import ended_error, ended_error_object
from shared.serving.openai.protocol import StreamOptions
from shared.serving.openai.responses_protocol import ResponseEvents

EVENT_STREAM = "text/event-stream"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def named_sse(event: dict[str, Any]) -> str:
    """A Responses stream event: the SSE event name is its type."""
    return f"event: {event['type']}\n{sse(event)}"


async def chunk_events(choices: Choices, options: StreamOptions, first: GenerateChunk,
                       chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    """SSE events, one per chunk of any choice; a client that hangs up cancels this generator (and with it
    the request)."""
    chunk = first
    try:
        while chunk is not None:
            payload = choices.streamed(chunk)
            if payload is not None:
                if options.continuous_usage:
                    payload["usage"] = choices.usage()
                elif options.include_usage:
                    payload["usage"] = None
                yield sse(payload)
            chunk = await anext(chunks, None)
        if options.include_usage:  # once every choice finished
            yield sse(choices.usage_chunk())
    except CallEnded as exc:
        yield sse(ended_error_object(exc))
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


async def response_events(events: ResponseEvents, choices: Choices, first: GenerateChunk,
                          chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    """Responses stream events (SSE with their event names, as OpenAI sends them) of a chat stream."""
    chunk, finish_reason = first, None
    try:
        for event in events.started():
            yield named_sse(event)
        while chunk is not None:
            payload = choices.streamed(chunk)
            for choice in payload["choices"] if payload is not None else ():
                finish_reason = choice.get("finish_reason") or finish_reason
                for event in events.chunk(choice):
                    yield named_sse(event)
            chunk = await anext(chunks, None)
        for event in events.finished(finish_reason, choices.usage()):
            yield named_sse(event)
    except CallEnded as exc:
        for event in events.failed(exc.details, exc.code.name.lower()):
            yield named_sse(event)
    finally:
        await chunks.aclose()


async def collect(request: Request, choices: Choices, first: GenerateChunk,
                  chunks: AsyncIterator[GenerateChunk]) -> Response | None:
    """Every chunk into choices (None), or the answer to a call that ended otherwise."""
    async def collect_all():
        choices.collect(first)
        async for chunk in chunks:
            choices.collect(chunk)
        return choices

    try:
        collected = await unless_disconnected(request, collect_all())
    except CallEnded as exc:
        return ended_error(exc)
    finally:
        await chunks.aclose()
    return Response(status_code=499) if collected is None else None


async def unless_disconnected(request: Request, work: Awaitable):
    """work's result, or None when the client hangs up first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
