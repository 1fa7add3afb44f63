"""The colocated server (colocated_svc): greedy streams equal the offline engine's generate(), bad input
gets INVALID_ARGUMENT with a precise message, and a cancelled call frees its KV blocks."""
import asyncio
import contextlib
import dataclasses
import time

import grpc
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from colocated_svc.servicer import ColocatedServicer
from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.serving.server.grpc_server import GrpcServer, ServerOptions
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.runtime import Pod, PodConfig, serving_cache_config
from shared.engine.request import FinishReason, SamplingParams

pytestmark = pytest.mark.e2e

SERVICE = "pdserve.v1.GenerateService"
NUM_BLOCKS = 128
MAX_MODEL_LEN = 512
PROMPTS = [[5, 17, 300, 42, 8], list(range(100, 140)), [4000, 3, 9], list(range(7, 60, 2))]


def word_tokenizer() -> Tokenizer:
    """One word per tiny-model token id: "w5 w17" <-> [5, 17]."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4096)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


@contextlib.asynccontextmanager
async def serving(tokenizer=None, **pod_options):
    pod = Pod(None, PodConfig(
        model="tiny",
        max_model_len=MAX_MODEL_LEN,
        cache=dataclasses.replace(serving_cache_config(), num_blocks=NUM_BLOCKS),
        **pod_options,
    ))
    pod.start()
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=tokenizer)
    servicer.attach(pod)
    server = GrpcServer(ServerOptions(host="127.0.0.1", port=0, grace_seconds=1.0))
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, SERVICE)
    server.on_shutdown(pod.stop)
    await server.start()
    await server.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield generate_pb2_grpc.GenerateServiceStub(channel), pod, servicer
    finally:
        await server.stop()


def request(prompt, request_id="", **sampling):
    message = generate_pb2.GenerateRequest(request_id=request_id, sampling=common_pb2.SamplingParams(**sampling))
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    return message


async def collect(stub, message):
    return [response async for response in stub.Generate(message, timeout=30)]


@pytest.mark.timeout(120)
def test_greedy_streams_equal_offline_generate():
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=9),
    ]
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=MAX_MODEL_LEN),
                       CacheConfig(num_blocks=NUM_BLOCKS))
    expected = engine.generate(PROMPTS, params)

    async def scenario():
        async with serving() as (stub, _, _):
            calls = [
                collect(stub, request(prompt, request_id=f"r{i}", max_tokens=p.max_tokens, ignore_eos=p.ignore_eos))
                for i, (prompt, p) in enumerate(zip(PROMPTS, params))
            ]
            return await asyncio.gather(*calls)

    for i, (responses, want) in enumerate(zip(asyncio.run(scenario()), expected)):
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == want.token_ids, f"prompt {i}"
        last = responses[-1]
        assert last.finish_reason == {FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
                                      FinishReason.STOP: common_pb2.FINISH_REASON_STOP}[want.finish_reason]
        assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        assert all(r.token_ids for r in responses)
        assert all(r.request_id == f"r{i}" and r.num_prompt_tokens == len(PROMPTS[i]) for r in responses)
        counts = [r.num_output_tokens for r in responses]
        assert counts == [sum(len(r.token_ids) for r in responses[: j + 1]) for j in range(len(responses))]


@pytest.mark.timeout(60)
def test_invalid_input_gets_invalid_argument():
    cases = [
        (generate_pb2.GenerateRequest(), "prompt is missing"),
        (request([]), "prompt token_ids is empty"),
        (request([1, 2, 4096]), "out of vocabulary"),
        (request(list(range(3, 3 + MAX_MODEL_LEN))), "maximum context length"),
        (request([1, 2, 3], top_p=1.5), "top_p"),
        (request([1, 2, 3], max_tokens=0), "max_tokens"),
        (request(""), "prompt text is empty"),
    ]

    async def scenario():
        async with serving() as (stub, pod, _):
            for message, needle in cases:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, message)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
                assert needle in info.value.details()
            # The pod still serves after all that.
            assert [t for r in await collect(stub, request([1, 2, 3], max_tokens=3, ignore_eos=True))
                    for t in r.token_ids]
            assert pod.loop.num_in_flight == 0

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_cancelled_call_aborts_and_frees_blocks():
    async def scenario():
        async with serving() as (stub, pod, _):
            idle_free = pod.load_report().num_free_blocks
            call = stub.Generate(request(list(range(10, 200)), max_tokens=300, ignore_eos=True), timeout=30)
            received = 0
            async for response in call:
                received += len(response.token_ids)
                if received >= 3:
                    break
            assert pod.load_report().num_free_blocks < idle_free
            call.cancel()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                load = pod.load_report()
                if pod.loop.num_in_flight == 0 and load.num_running == 0 and load.num_free_blocks == idle_free:
                    break
                await asyncio.sleep(0.02)
            load = pod.load_report()
            assert pod.loop.num_in_flight == 0 and load.num_running == 0 and load.num_waiting == 0
            assert load.num_free_blocks == idle_free

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_text_prompt_is_tokenized_and_streamed_back_as_text():
    async def scenario():
        async with serving(word_tokenizer()) as (stub, _, _):
            by_text = await collect(stub, request("w5 w17 w300 w42 w8", max_tokens=6, ignore_eos=True))
            by_ids = await collect(stub, request(PROMPTS[0], max_tokens=6, ignore_eos=True))
            return by_text, by_ids

    by_text, by_ids = asyncio.run(scenario())
    tokens = [t for r in by_text for t in r.token_ids]
    assert tokens == [t for r in by_ids for t in r.token_ids]
    assert by_text[-1].num_prompt_tokens == 5
    assert "".join(r.text for r in by_text).split() == [f"w{t}" for t in tokens]


@pytest.mark.timeout(120)
def test_n_completions_are_admitted_together_or_not_at_all():
    async def scenario():
        async with serving(max_requests_in_flight=2) as (stub, pod, _):
            with pytest.raises(grpc.aio.AioRpcError) as never:
                await collect(stub, request(PROMPTS[0], max_tokens=4, n=3, seed=1))
            assert never.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 2 requests at once" in never.value.details()
            busy = stub.Generate(request(PROMPTS[1], max_tokens=400, ignore_eos=True), timeout=30)
            await busy.read()  # one request in flight: two more would pass the limit
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await collect(stub, request(PROMPTS[0], max_tokens=4, n=2, seed=1))
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            busy.cancel()
            for _ in range(100):
                if pod.loop.num_in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            answers = await collect(stub, request(PROMPTS[0], max_tokens=4, n=2, seed=1))
            assert sum(len(a.token_ids) for a in answers) == 8

    asyncio.run(scenario())
