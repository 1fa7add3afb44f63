"""The OpenAI-compatible HTTP front, driven by the official `openai` client: against the colocated server
(in process) and the split system (router + prefill + decode processes). Completions and chat, streaming
and not, usage, OpenAI-shaped errors with the right status, and a client that hangs up freeing its blocks."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import urllib.request

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colocated_svc.servicer import ColocatedServicer
from shared.engine.model.dtype_choice import DTYPE_AUTO
from shared.engine.request import MAX_LOGPROBS, MAX_N
from shared.engine.request import FinishReason
from shared.serving.generation import GenerateChunk
from shared.serving.server.http_server import HttpServer
from shared.serving.openai.app import HttpFront
from shared.serving.openai.config import COMPLETIONS_PATH, HttpConfig
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.runtime import Pod, PodConfig, serving_cache_config
from shared.serving.server.telemetry import Tracing, TracingConfig, setup_tracing
from shared.serving.text import TextCodec
from tests.otlp_receiver import OtlpReceiver, children_of

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 128
MAX_MODEL_LEN = 512
PROMPT = "The router streams tokens from the decode pod"


@contextlib.asynccontextmanager
async def colocated_http(tracing: Tracing | None = None, codec: TextCodec | None = None, model: str = "tiny",
                         dtype: str = DTYPE_AUTO, **front_options):
    """A colocated pod (tiny, with its preset tokenizer, unless model names another) behind the HTTP front;
    yields (client, pod, url). tracing: the service's tracing, when traced; codec: the front's (default: the
    model's)."""
    pod = Pod(None, PodConfig(
        model=model,
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        cache=dataclasses.replace(serving_cache_config(), num_blocks=NUM_BLOCKS),
    ))
    pod.start()
    codec = codec or TextCodec.from_path(model)
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=codec.tokenizer)
    servicer.attach(pod)
    if tracing is not None:
        servicer.use_tracing(tracing)
        pod.loop.is_timing_requests = True  # the timelines feed the stage spans
    front = HttpFront(servicer.generate, model_name=model, codec=lambda: codec, registry=servicer.metrics.registry,
                      is_ready=lambda: True, max_model_len=lambda: pod.max_model_len,
                      tracer=lambda: servicer.tracing.tracer, **front_options)
    server = HttpServer(front.app, "127.0.0.1", 0)
    await server.start()
    try:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            yield client, pod, server.url
    finally:
        await server.stop()
        await pod.stop()


async def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _all_free(pod: Pod) -> bool:
    load = pod.load_report()
    return pod.loop.num_in_flight == 0 and load.num_free_blocks == load.num_total_blocks


@pytest.mark.timeout(120)
def test_colocated_completions_and_chat_streaming_and_not_with_usage():
    async def scenario():
        async with colocated_http() as (client, pod, _):
            whole = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
            assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
            assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
            stream = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = [chunk async for chunk in stream]
            # Greedy: the streamed text (incrementally detokenized) is the whole response's text.
            assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
            assert all(c.usage is None for c in chunks[:-1])
            # Token-id prompts, as vLLM takes them, give the same output as the text they encode to.
            ids = TextCodec.from_path("tiny").encode(PROMPT)
            by_ids = await client.completions.create(
                model="tiny", prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            assert by_ids.choices[0].text == whole.choices[0].text

            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, wörld 日本"}]
            chat = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
            assert chat.usage.completion_tokens == chat.usage.total_tokens - chat.usage.prompt_tokens
            chat_stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
            deltas = [chunk async for chunk in chat_stream]
            assert deltas[0].choices[0].delta.role == "assistant"
            assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
            assert deltas[-1].choices[0].finish_reason == chat.choices[0].finish_reason
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_colocated_stop_penalties_and_json_schema_through_the_openai_client():
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}

    async def scenario():
        async with colocated_http() as (client, pod, url):
            free = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                   extra_body={"ignore_eos": True})
            text = free.choices[0].text
            stop = text[4:7]
            cut = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                  stop=[stop], extra_body={"ignore_eos": True})
            assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
            penalized = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, frequency_penalty=2.0,
                presence_penalty=1.0, extra_body={"ignore_eos": True, "min_tokens": 3})
            assert penalized.choices[0].text != text
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "colour?"}], max_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
            jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
            choice = await client.chat.completions.create(  # vLLM's current form of its constraints
                model="tiny", messages=[{"role": "user", "content": "colour?"}], max_tokens=10, temperature=1.0,
                extra_body={"structured_outputs": {"choice": ["red", "green"]}})
            assert choice.choices[0].message.content in ("red", "green")
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_colocated_errors_are_openai_shaped_with_the_right_status():
    async def scenario():
        async with colocated_http() as (client, pod, url):
            cases = [
                (dict(model="tiny", prompt=PROMPT, max_tokens=0), openai.BadRequestError, "max_tokens"),
                (dict(model="tiny", prompt=PROMPT, n=MAX_N + 1), openai.BadRequestError, "n must be"),
                (dict(model="tiny", prompt=PROMPT, logprobs=MAX_LOGPROBS + 1), openai.BadRequestError,
                 f"logprobs must be in [0, {MAX_LOGPROBS}]"),
                (dict(model="tiny", prompt=PROMPT, extra_body={"best_of": 2}), openai.BadRequestError, "'best_of'"),
                (dict(model="tiny", prompt=[1, 2, 4096]), openai.BadRequestError, "out of vocabulary"),
                (dict(model="tiny", prompt=[5] * MAX_MODEL_LEN), openai.BadRequestError, "maximum context length"),
                (dict(model="tiny", prompt=PROMPT, temperature=-1), openai.BadRequestError, "temperature"),
                (dict(model="tiny", prompt=PROMPT, extra_body={"bogus": 1}), openai.BadRequestError, "'bogus'"),
                (dict(model="gpt-9", prompt=PROMPT), openai.NotFoundError, "gpt-9"),
            ]
            for kwargs, error, needle in cases:
                for stream in (False, True):
                    with pytest.raises(error) as info:
                        await client.completions.create(stream=stream, **kwargs)
                    assert needle in info.value.body["message"], (kwargs, info.value.body)
                    assert info.value.body["type"] == "invalid_request_error"
            async with httpx.AsyncClient() as http:
                answer = await http.post(f"{url}/v1/chat/completions", content=b"{not json")
                assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]
                assert (await http.get(f"{url}/health")).status_code == 200
                metrics = (await http.get(f"{url}/metrics")).text
                assert "vllm:num_requests_waiting" in metrics and "pdserve_requests_total" in metrics
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_colocated_hostile_bodies_get_precise_4xx_and_the_server_serves_on():
    hostile = [
        (b'{"model": "tiny", "prompt": "\\ud800 x"}', 400, "unpaired UTF-16 surrogate"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests too deeply"),
        (b'{"prompt": "hi", "max_tokens": 1099511627776}', 400, "max_tokens"),
        (b'{"prompt": [1, -2]}', 400, "prompt"),
        (b'{"prompt": "hi", "stop_token_ids": [4294967296]}', 400, "stop_token_ids"),
        (b'{"prompt": "hi", "logit_bias": {"99999": 1}}', 400, "logit_bias"),
        (b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}', 413, "larger than 1 MiB"),
    ]

    async def scenario():
        async with colocated_http(config=HttpConfig(http_max_body_mib=1)) as (client, pod, url):
            async with httpx.AsyncClient(timeout=60) as http:
                for body, status, needle in hostile:
                    answer = await http.post(f"{url}/v1/completions", content=body)
                    assert answer.status_code == status, (body[:60], answer.text)
                    assert needle in answer.json()["error"]["message"], (body[:60], answer.text)
                for method, path, status in (("GET", "/v1/nothing", 404), ("GET", COMPLETIONS_PATH, 405)):
                    answer = await http.request(method, f"{url}{path}")
                    assert answer.status_code == status and answer.json()["error"]["code"] == status
            whole = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            assert whole.usage.completion_tokens == 4
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_colocated_chat_without_a_template_is_a_400():
    async def scenario():
        codec = TextCodec(TextCodec.from_path("tiny").tokenizer, chat_template=None)
        async with colocated_http(codec=codec) as (client, _, _url):
            with pytest.raises(openai.BadRequestError, match="chat template"):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_long_prompt_is_tokenized_off_the_event_loop():
    # About 6 MB of text: seconds of tokenizing (then refused for its length), while health checks and
    # other requests on the same event loop go on being answered.
    async def scenario():
        async with colocated_http() as (client, pod, url):
            async with httpx.AsyncClient(timeout=120) as http:
                big = asyncio.ensure_future(http.post(f"{url}/v1/completions",
                                                      json={"prompt": "hello world " * 500_000, "max_tokens": 1}))
                await asyncio.sleep(0.3)
                latencies = []
                while not big.done():
                    started = time.monotonic()
                    assert (await http.get(f"{url}/health")).status_code == 200
                    latencies.append(time.monotonic() - started)
                    await asyncio.sleep(0.05)
                answer = await big
                assert answer.status_code == 400 and "maximum context length" in answer.json()["error"]["message"]
                assert len(latencies) >= 3 and max(latencies) < 1.0, latencies

    asyncio.run(scenario())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [True, False])
def test_colocated_client_hang_up_aborts_and_frees_blocks(stream):
    async def scenario():
        async with colocated_http() as (_, pod, url):
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": stream}
            async with httpx.AsyncClient() as http:
                request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
                await _wait_until(lambda: pod.loop.num_in_flight == 1)
                await asyncio.sleep(0.2)
                request.cancel()  # closes the connection
                with contextlib.suppress(asyncio.CancelledError):
                    await request
                await _wait_until(lambda: _all_free(pod))
                metrics = (await http.get(f"{url}/metrics")).text
            assert _count(metrics, "cancelled") == 1 and _count(metrics, "ok") == 0

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_colocated_http_request_is_one_trace_with_the_pods_stage_spans():
    trace_id, client_span_id = "6e0c63257de34c92bf9efcd03927272e", "00f067aa0ba902b7"

    async def scenario(receiver: OtlpReceiver):
        tracing = setup_tracing(TracingConfig("pdserve-colocated", otlp_endpoint=receiver.endpoint))
        try:
            async with colocated_http(tracing) as (client, pod, url):
                chat = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"traceparent": f"00-{trace_id}-{client_span_id}-01"})
                assert {chunk.choices[0].index async for chunk in chat} == {0, 1}
                async with httpx.AsyncClient() as http:  # probes are not traced
                    assert (await http.get(f"{url}/health")).status_code == 200
        finally:
            tracing.shutdown()  # exports everything

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver))
        assert receiver.wait_for(lambda spans: len(spans) >= 5, timeout=10)
        spans = receiver.spans()
    assert {span.trace_id for span in spans} == {trace_id}
    [root] = [span for span in spans if span.name == "POST /v1/chat/completions"]
    assert root.kind == "SERVER" and root.parent_span_id == client_span_id
    assert root.attributes["http.response.status_code"] == 200
    # Both choices' queue and compute spans hang under the HTTP span; they end before it does.
    stages = sorted(span.name for span in children_of(spans, root))
    assert stages == ["colocated", "colocated", "colocated-queue", "colocated-queue"]
    assert all(span.end_time_ns <= root.end_time_ns for span in spans)


def _count(metrics_text: str, outcome: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
               if sample.name == "pdserve_requests_total" and sample.labels.get("outcome") == outcome)


# ---- the split system -------------------------------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


def _num_cancelled(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return _count(answer.read().decode(), "cancelled")


def _wait_pods_idle(cluster, timeout_s: float = 15.0) -> None:
    """Through the pods' metrics: no KV block in use or held, nothing running."""
    pods = [cluster.by_name("prefill-0"), cluster.by_name("decode-0")]
    deadline = time.monotonic() + timeout_s
    while True:
        samples = [_scrape(pod.metrics_url) for pod in pods]
        if all(s["vllm:kv_cache_usage_perc"] == 0 and s["pdserve_kv_blocks_held_for_peer"] == 0
               and s["vllm:num_requests_running"] == 0 for s in samples):
            return
        assert time.monotonic() < deadline, f"pods still busy: {samples}"
        time.sleep(0.2)


# The split tests keep pytest's default timeout: the first to run also pays the shared cluster's start.
@pytest.fixture
def split_client(split_cluster):
    with openai.OpenAI(base_url=split_cluster.router.http_url, api_key="unused", max_retries=0) as client:
        yield client


def test_split_completions_and_chat_match_grpc_text(split_cluster, split_client):
    from pdserve.client import PdserveClient

    with PdserveClient(split_cluster.router.address) as grpc_client:
        grpc_text = "".join(c.text for c in grpc_client.generate(PROMPT, max_tokens=10, ignore_eos=True, timeout=60))
    whole = split_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == grpc_text
    assert (whole.usage.completion_tokens, whole.choices[0].finish_reason) == (10, "length")
    streamed = list(split_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == grpc_text
    assert streamed[-1].usage.completion_tokens == 10
    chat = split_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0)
    chat_stream = list(split_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream) == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6 or chat.choices[0].finish_reason == "stop"
    _wait_pods_idle(split_cluster)


def test_split_errors_and_health(split_cluster, split_client):
    with pytest.raises(openai.BadRequestError) as info:
        split_client.completions.create(model="tiny", prompt=[1, 2, 99999], max_tokens=4)
    assert "vocabulary" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        split_client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert "messages" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        split_client.completions.create(model="other", prompt=PROMPT, max_tokens=4)
    base = split_cluster.router.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
        assert answer.status == 200
    assert "pdserve_router_requests_total" in urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    _wait_pods_idle(split_cluster)


def test_split_stream_hang_up_frees_blocks_on_both_pods(split_cluster, split_client):
    decode_metrics = split_cluster.by_name("decode-0").metrics_url
    cancelled_before = _num_cancelled(decode_metrics)
    stream = split_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received >= 3:
            break
    stream.close()  # hangs up the HTTP connection
    _wait_pods_idle(split_cluster)
    # The hang-up reached the decode pod as a cancellation (not a finished request).
    assert _num_cancelled(decode_metrics) == cancelled_before + 1


def test_split_router_refuses_a_prompt_beyond_the_model_length_without_forwarding_it(split_cluster, split_client):
    prefill_metrics = split_cluster.by_name("prefill-0").metrics_url
    invalid_before = _count(urllib.request.urlopen(prefill_metrics, timeout=5).read().decode(), "invalid")
    with pytest.raises(openai.BadRequestError) as info:
        split_client.completions.create(model="tiny", prompt=[5] * 2100, max_tokens=4)
    # The limit came from the pods' load reports (the tiny preset's 2048 positions).
    # OpenAI's words, which clients detect a context overflow by.
    assert info.value.body["message"].startswith("This model's maximum context length is 2048 tokens. However, you "
                                                 "requested 2104 tokens (2100 in the messages, 4 in the completion).")
    # A chat request that named no max_tokens is told its prompt leaves no room (not of a max_tokens it never sent).
    with pytest.raises(openai.BadRequestError) as chat:
        split_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go " * 2100}])
    assert "maximum context length is 2048 tokens" in chat.value.body["message"]
    assert "1 in the completion" in chat.value.body["message"]
    assert "max_tokens" not in chat.value.body["message"]
    assert _count(urllib.request.urlopen(prefill_metrics, timeout=5).read().decode(), "invalid") == invalid_before
    assert split_client.models.list().data[0].max_model_len == 2048


@pytest.mark.timeout(60)
def test_an_internal_error_is_an_openai_error_object_and_the_server_serves_on():
    async def failing_generate(work, on_end=None):
        raise RuntimeError("simulated bug")
        yield  # an async generator, as the servicers' Generate

    async def scenario():
        front = HttpFront(failing_generate, model_name="m", codec=lambda: None, registry=ServiceMetrics().registry,
                          is_ready=lambda: True)
        server = HttpServer(front.app, "127.0.0.1", 0)
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                for _ in range(2):
                    answer = await http.post(f"{server.url}{COMPLETIONS_PATH}", json={"prompt": [1, 2]})
                    assert answer.status_code == 500
                    assert answer.json()["error"] == {"message": "internal error: RuntimeError",
                                                      "type": "server_error", "param": None, "code": 500}
                assert (await http.get(f"{server.url}/health")).status_code == 200
        finally:
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_model_retrieve_tokenize_and_detokenize():
    async def scenario():
        codec = TextCodec.from_path("tiny")
        async with colocated_http() as (client, _, url):
            card = await client.models.retrieve("tiny")
            assert (card.id, card.model_extra["max_model_len"]) == ("tiny", MAX_MODEL_LEN)
            with pytest.raises(openai.NotFoundError, match="gpt-9"):
                await client.models.retrieve("gpt-9")
            async with httpx.AsyncClient() as http:
                tokens = (await http.post(f"{url}/tokenize", json={"model": "tiny", "prompt": PROMPT})).json()
                assert tokens == {"count": len(codec.encode(PROMPT)), "max_model_len": MAX_MODEL_LEN,
                                  "tokens": codec.encode(PROMPT)}
                messages = [{"role": "user", "content": "hi"}]
                chat = (await http.post(f"{url}/tokenize", json={"messages": messages})).json()
                assert chat["tokens"] == codec.encode_chat(messages)
                text = (await http.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]})).json()
                assert text == {"prompt": PROMPT}
                strs = (await http.post(f"{url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True})).json()
                assert strs["token_strs"] == codec.token_texts(tokens["tokens"])
                for path, body, needle in (("/detokenize", {"tokens": [1, 99999]}, "vocabulary"),
                                           ("/detokenize", {"tokens": "abc"}, "tokens must be"),
                                           ("/tokenize", {"prompt": 5}, "'prompt'"),
                                           ("/tokenize", {"prompt": "x", "bogus": 1}, "'bogus'")):
                    answer = await http.post(f"{url}{path}", json=body)
                    assert answer.status_code == 400 and needle in answer.json()["error"]["message"], answer.text

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_models_wait_for_readiness_cors_and_the_models_path_as_its_name():
    """/v1/models answers only once the model serves (clients take a listed model as ready); browsers get
    CORS answers; the path the model was loaded from names it too, as in vLLM."""
    ready = False

    async def generate(work, on_end=None):
        yield GenerateChunk("r", token_ids=[1], text="x", num_prompt_tokens=1, num_output_tokens=1,
                            finish_reason=FinishReason.LENGTH)

    async def scenario():
        front = HttpFront(generate, model_name="m", codec=lambda: None, registry=ServiceMetrics().registry,
                          is_ready=lambda: ready, model_aliases=("/models/org/m",),
                          config=HttpConfig(http_allowed_origins="https://app.example"))
        server = HttpServer(front.app, "127.0.0.1", 0)
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                answer = await http.get(f"{server.url}/v1/models")
                assert answer.status_code == 503 and "not ready" in answer.json()["error"]["message"]
                nonlocal ready
                ready = True
                assert (await http.get(f"{server.url}/v1/models")).json()["data"][0]["id"] == "m"
                for model in ("m", "/models/org/m"):
                    answer = await http.post(f"{server.url}{COMPLETIONS_PATH}", json={"model": model, "prompt": [1]})
                    assert answer.status_code == 200, answer.text
                preflight = await http.options(f"{server.url}{COMPLETIONS_PATH}", headers={
                    "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"})
                assert preflight.status_code == 200
                assert preflight.headers["access-control-allow-origin"] == "https://app.example"
                listed = await http.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})
                assert listed.headers["access-control-allow-origin"] == "https://app.example"
                other = await http.get(f"{server.url}/v1/models", headers={"Origin": "https://evil.example"})
                assert "access-control-allow-origin" not in other.headers
        finally:
            await server.stop()

    asyncio.run(scenario())
