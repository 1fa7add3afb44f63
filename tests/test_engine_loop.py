"""The engine loop thread: outputs reach their streams in order, aborts free blocks, and a crashing
engine fails every stream in flight instead of leaving a caller waiting forever."""
from __future__ import annotations

import asyncio

import pytest

from shared.engine.kv_transfer.connector import KVConnectorBase, KVRole
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.serving.engine_thread import EngineLoop, EngineStopped
from shared.engine.request import Request, SamplingParams


def _engine() -> LLMEngine:
    return LLMEngine("tiny", SchedulerConfig(max_model_len=512), CacheConfig(num_blocks=64))


def _request(request_id: str, max_tokens: int) -> Request:
    return Request(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def test_outputs_stream_in_order_and_match_generate():
    engine = _engine()
    expected = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids

    async def run() -> list[int]:
        loop = EngineLoop(engine)
        loop.start()
        tokens = [t async for output in loop.submit(_request("a", 12)) for t in output.new_token_ids]
        await loop.stop()
        return tokens

    assert asyncio.run(run()) == expected


def test_abort_frees_the_request_blocks():
    engine = _engine()

    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        stream = loop.submit(_request("long", 400))
        await stream.__anext__()  # running now
        loop.abort("long")
        await loop.stop()

    asyncio.run(run())
    usage = engine.kv_usage()
    assert usage.num_free_blocks == usage.num_total_blocks


def test_a_crashing_engine_fails_every_stream_in_flight():
    engine = _engine()
    real_step = engine.step
    num_steps = 0

    def step_then_crash():
        nonlocal num_steps
        num_steps += 1
        if num_steps > 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.step = step_then_crash

    async def run() -> EngineLoop:
        loop = EngineLoop(engine)
        loop.start()
        streams = [loop.submit(_request(f"r{i}", 50)) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineStopped, match="simulated kernel failure"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineStopped):
            loop.submit(_request("late", 5))
        await asyncio.wait_for(loop.stop(), 10)
        return loop

    loop = asyncio.run(asyncio.wait_for(run(), 30))
    assert isinstance(loop.error, RuntimeError)


class _CountingConnector(KVConnectorBase):
    """A producer with no holds, counting the idle progress calls (a NIXL agent's UCX progress)."""

    def __init__(self):
        super().__init__(KVRole.PRODUCER)
        self.num_idle_progress = 0

    def progress_while_idle(self) -> None:
        self.num_idle_progress += 1


def test_an_idle_loop_keeps_its_kv_transfers_progressing():
    """A peer's READ can outlive the hold it reads (its client hung up): with no work left, this side's
    UCX must still advance, or that READ and the peer's blocks wait for the next request."""
    connector = _CountingConnector()
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=512), CacheConfig(num_blocks=64), connector)

    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        await asyncio.sleep(0.3)  # about six idle waits
        await loop.stop()

    asyncio.run(run())
    assert connector.num_idle_progress >= 3
