"""The engine loop thread: outputs reach their streams in order, aborts free blocks, and a crashing
engine fails every stream in flight instead of leaving a caller waiting forever."""
from __future__ import annotations

import asyncio

import pytest

from shared.engine.kv_transfer.connector import KVConnectorBase, KVLoadFailurePolicy, KVRole
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.serving.pod.engine_thread import EngineLoop, EngineStopped
from shared.serving.pod.outcomes import DuplicateRequestId, InvalidRequest
from shared.engine.request import Request, SamplingParams, StructuredOutputSpec


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
        super().__init__(KVRole.PRODUCER, KVLoadFailurePolicy.RECOMPUTE)
        self.num_idle_progress = 0

    def progress_while_idle(self) -> None:
        self.num_idle_progress += 1


@pytest.mark.slow
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


def _refusal(engine: LLMEngine, request: Request) -> BaseException:
    """What submitting `request` raises on its stream; then the loop must still serve a plain request."""

    async def run() -> BaseException:
        loop = EngineLoop(engine)
        loop.start()
        stream = loop.submit(request)
        with pytest.raises(Exception) as refused:
            async for _ in stream:
                pass
        assert stream.refused
        tokens = [t async for output in loop.submit(_request("after", 3)) for t in output.new_token_ids]
        assert len(tokens) == 3 and loop.error is None
        await loop.stop()
        return refused.value

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_input_nested_past_the_recursion_limit_is_refused_and_the_loop_serves_on():
    schema = '{"type":"array","items":' * 5000 + "{}" + "}" * 5000
    request = Request("deep", [5, 6, 7], SamplingParams(max_tokens=3, structured_output=StructuredOutputSpec(
        json_schema=schema)), eos_token_id=2)
    error = _refusal(_engine(), request)
    assert isinstance(error, InvalidRequest) and "nests too deeply" in str(error)


def test_an_unexpected_error_while_adding_fails_that_request_only():
    engine = _engine()
    real_add = engine.add_request

    def add_or_fail(request):
        if request.request_id == "bad":
            raise RuntimeError("simulated bug")
        real_add(request)

    engine.add_request = add_or_fail
    error = _refusal(engine, _request("bad", 3))
    assert isinstance(error, RuntimeError) and "simulated bug" in str(error)


def test_an_id_the_engine_still_holds_is_refused_as_a_duplicate_and_not_aborted():
    engine = _engine()

    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        first = loop.submit(_request("same", 400))
        await first.__anext__()  # running now
        # A caller whose own stream ended can reach the engine with an id it still runs.
        loop._streams.pop("same")
        second = loop.submit(_request("same", 3))
        with pytest.raises(DuplicateRequestId):
            async for _ in second:
                pass
        assert second.refused
        await asyncio.sleep(0.2)
        assert engine.has_unfinished_requests()  # the first request was not aborted by the refusal
        loop.abort("same")
        await loop.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
