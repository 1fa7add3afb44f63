"""A checkpoint's generation_config.json sampling defaults (vLLM's --generation-config auto) over gRPC and
the OpenAI HTTP API, colocated and through the split system (router -> prefill -> decode): a request that
leaves temperature, top_k, top_p and repetition_penalty unset samples with the checkpoint's values, an
explicit field wins, and the split system gives the single-process engine's tokens for the filled
params (token 1 on the prefill pod, the rest on the decode pod). The prefill pod resolves the params and
the decode pod continues with them: its own --generation-config (vllm here) plays no part. Seeded, so
every output is exact.
max_new_tokens is the max_tokens of a request that names none (within the model's length), as in vLLM:
gRPC and chat; completions keep OpenAI's 16."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging

import openai
import pytest

from bpe_tokenizer import bpe_tokenizer
from colocated_svc.servicer import ColocatedServicer
from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from shared.engine.llm_engine import LLMEngine
from shared.engine.model.loader import load_model, save_pretrained
from shared.engine.request import FinishReason, SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.server.http_server import HttpServer
from shared.serving.openai.app import HttpFront
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.runtime import Pod, PodConfig
from shared.serving.text import TextCodec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_MODEL_LEN = 256
PROMPT = [17, 901, 33, 2048, 77, 5, 1200, 64, 9]
SEED = 7
# Sampled (not greedy) defaults, each field a request may leave unset.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.3}
MAX_NEW_TOKENS = 5  # below OpenAI's completions default (16) and every fallback
REQUEST = dict(max_tokens=8, ignore_eos=True, seed=SEED)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-with-generation-config")
    save_pretrained(load_model("tiny", seed=0), path)
    bpe_tokenizer().save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "max_new_tokens": MAX_NEW_TOKENS, **DEFAULTS}))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}"}))
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """The single-process engine's tokens for explicit sampling params (none left unset)."""
    engine = LLMEngine(model_dir, SchedulerConfig(max_model_len=MAX_MODEL_LEN), CacheConfig(block_size=16, num_blocks=64))

    def tokens(**explicit) -> list[int]:
        return engine.generate([PROMPT], SamplingParams(**REQUEST, **explicit))[0].token_ids
    return tokens


@pytest.fixture(scope="module")
def expected(reference):
    """The engine's tokens for what each request should sample with, by name."""
    tokens = {
        "defaults": reference(**DEFAULTS),
        # An explicit temperature wins; the fields still unset keep the checkpoint's values.
        "explicit temperature 0": reference(**{**DEFAULTS, "temperature": 0.0}),
        "greedy": reference(temperature=0.0, repetition_penalty=1.0),
        # What an OpenAI request that is silent gets without the checkpoint's defaults (OpenAI's temperature 1).
        "openai without defaults": reference(temperature=1.0),
    }
    assert len({tuple(t) for t in tokens.values()}) == len(tokens), f"the cases must differ: {tokens}"
    return tokens


def _grpc_tokens(address: str, **sampling) -> tuple[list[int], str]:
    tokens, text = [], ""
    with PdserveClient(address) as client:
        for chunk in client.generate(PROMPT, timeout=120, **REQUEST, **sampling):
            tokens += chunk.token_ids
            text += chunk.text
    return tokens, text


def _grpc_lengths(address: str, prompt: list[int], **sampling) -> dict[int, tuple[int, FinishReason]]:
    """Per completion index: how many tokens it got and how it finished."""
    lengths: dict[int, tuple[int, FinishReason]] = {}
    with PdserveClient(address) as client:
        for chunk in client.generate(prompt, timeout=120, ignore_eos=True, seed=SEED, **sampling):
            count, finish = lengths.get(chunk.index, (0, None))
            lengths[chunk.index] = (count + len(chunk.token_ids), chunk.finish_reason or finish)
    return lengths


def _check_max_new_tokens(router) -> None:
    """A request that names no max_tokens gets the checkpoint's max_new_tokens, within the room the prompt
    leaves; the router lets it by though the gRPC fallback (16) would not fit."""
    length = FinishReason.LENGTH
    assert _grpc_lengths(router.address, PROMPT) == {0: (MAX_NEW_TOKENS, length)}
    assert _grpc_lengths(router.address, PROMPT, n=2) == {0: (MAX_NEW_TOKENS, length), 1: (MAX_NEW_TOKENS, length)}
    assert _grpc_lengths(router.address, PROMPT, max_tokens=7) == {0: (7, length)}  # not a cap
    room_of = {11: MAX_NEW_TOKENS, 3: 3}  # room the prompt leaves -> tokens
    for room, count in room_of.items():
        prompt = [17 + i % 500 for i in range(MAX_MODEL_LEN - room)]
        assert _grpc_lengths(router.address, prompt) == {0: (count, length)}
    with openai.OpenAI(base_url=router.http_url, api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              seed=SEED, extra_body={"ignore_eos": True})
        assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (MAX_NEW_TOKENS, "length")
        # Completions default to 16 as if the client sent it (vLLM's CompletionRequest): no model default.
        whole = client.completions.create(model=model, prompt=PROMPT, seed=SEED, extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 16


def _http_text(client: openai.OpenAI, **sampling) -> str:
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=REQUEST["max_tokens"], seed=SEED,
                                      extra_body={"ignore_eos": True}, **sampling)
    return whole.choices[0].text


def test_split_system_fills_unset_fields_from_the_checkpoint_over_grpc_and_http(model_dir, expected, tmp_path):
    pod_args = ["--model", str(model_dir), "--block-size", "16", "--num-blocks", "128",
                "--max-model-len", str(MAX_MODEL_LEN)]
    # The decode pod ignores the checkpoint's sampling itself: the outputs below equal the checkpoint
    # defaults' only because it continues with the params the prefill pod resolved.
    with LocalCluster.start(pod_args=pod_args, decode_args=["--generation-config", "vllm"],
                            router_args=["--tokenizer", str(model_dir)], log_dir=tmp_path, timeout_s=300) as cluster:
        router = cluster.by_name("router")
        tokens, text = _grpc_tokens(router.address)
        assert tokens == expected["defaults"]
        explicit, explicit_text = _grpc_tokens(router.address, temperature=0.0)
        assert explicit == expected["explicit temperature 0"]
        assert _grpc_tokens(router.address, temperature=0.0, repetition_penalty=1.0)[0] == expected["greedy"]
        with openai.OpenAI(base_url=router.http_url, api_key="unused", max_retries=0) as client:
            # Silent on temperature: the checkpoint's 0.8, not OpenAI's 1, so the same text as over gRPC.
            assert _http_text(client) == text
            assert _http_text(client, temperature=0) == explicit_text
        _check_max_new_tokens(router)
        assert LOGGED_DEFAULTS in (tmp_path / "prefill-0.log").read_text()
        assert "sampling defaults (--generation-config vllm): none" in (tmp_path / "decode-0.log").read_text()


LOGGED_DEFAULTS = ("sampling defaults (--generation-config auto): max_tokens=5 (for requests that name none, within "
                   "the model's length; not a cap), repetition_penalty=1.3, temperature=0.8, top_k=40, top_p=0.95")


@contextlib.asynccontextmanager
async def _colocated_http(model_dir, mode: str):
    """A colocated pod on the checkpoint behind the HTTP front; yields (OpenAI client, codec)."""
    pod = Pod(None, PodConfig(
        model=str(model_dir), generation_config=mode,
        cache=dataclasses.replace(PodConfig().cache, num_blocks=64),
        max_model_len=MAX_MODEL_LEN,
    ))
    pod.start()
    codec = TextCodec.from_path(str(model_dir))
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=codec.tokenizer)
    servicer.attach(pod)
    front = HttpFront(servicer.generate, model_name="m", codec=lambda: codec, registry=servicer.metrics.registry,
                      is_ready=lambda: True, max_model_len=lambda: pod.max_model_len)
    server = HttpServer(front.app, "127.0.0.1", 0)
    await server.start()
    try:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            yield client, codec
    finally:
        await server.stop()
        await pod.stop()


@pytest.mark.timeout(120)
def test_colocated_fills_unset_fields_and_vllm_mode_ignores_them(model_dir, expected, caplog):
    async def silent_request(mode: str) -> tuple[str, str]:
        async with _colocated_http(model_dir, mode) as (client, codec):
            whole = await client.completions.create(model="m", prompt=PROMPT, max_tokens=REQUEST["max_tokens"],
                                                    seed=SEED, extra_body={"ignore_eos": True})
            return whole.choices[0].text, codec

    with caplog.at_level(logging.INFO, logger="shared.serving.pod.runtime"):
        text, codec = asyncio.run(silent_request("auto"))
    assert LOGGED_DEFAULTS in caplog.text
    assert text == codec.tokenizer.decode(expected["defaults"])
    with caplog.at_level(logging.INFO, logger="shared.serving.pod.runtime"):
        text, codec = asyncio.run(silent_request("vllm"))
    assert "sampling defaults (--generation-config vllm): none" in caplog.text
    assert text == codec.tokenizer.decode(expected["openai without defaults"])
