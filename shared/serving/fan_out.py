"""n > 1: one prompt run as n independent completions, streamed interleaved with their index.

Child i samples with seed + i when the request is seeded (vLLM's parallel sampling), so a seeded
request with n > 1 gives the same completions on the router and on the colocated server.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from shared.engine.request import SamplingParams

_DONE = object()


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)


async def merge(make_stream: Callable[[int], AsyncIterator], count: int) -> AsyncIterator:
    """Items of make_stream(0..count-1) as they come. The first error ends everything and is raised;
    leaving early (or being cancelled) cancels every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for item in make_stream(index):
                await queue.put(item)
            await queue.put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(index)) for index in range(count)]
    try:
        remaining = count
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
