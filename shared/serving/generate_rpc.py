"""gRPC Generate as a thin adapter over a domain generate(): the message becomes a GenerateInput, each chunk
a GenerateResponse, and a CallEnded the call's status."""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Callable

import grpc

from proto.pdserve.v1 import generate_pb2
from shared.serving.wire.generate import generate_chunk_to_proto, generate_input_from_proto
from shared.serving.generation import CallEnded, Generate


async def serve_generate(
    generate: Generate, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext, *,
    on_invalid: Callable[[], None] = lambda: None,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """The Generate call's messages; on_invalid runs when the message itself is unusable."""
    try:
        work = generate_input_from_proto(request, context.time_remaining())
    except ValueError as exc:
        on_invalid()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def on_end(cleanup: Callable[[], None]) -> None:
        context.add_done_callback(lambda _context: cleanup())

    chunks = generate(work, on_end=on_end)
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield generate_chunk_to_proto(chunk)
    except CallEnded as exc:
        await context.abort(exc.code, exc.details, trailing_metadata=exc.trailing_metadata)
