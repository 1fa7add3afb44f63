"""Each sampling option through the split system (router -> prefill -> NIXL pull -> decode, three OS
processes) gives exactly the colocated server's output: stop strings across token boundaries,
penalties and min_tokens, logit bias, logprobs, n, seeded sampling and JSON-schema output. Both run the
tiny preset's weights saved as a model directory with a BPE tokenizer, so text and grammars work."""
from __future__ import annotations

import json
import time

import grpc
import jsonschema
import pytest

from bpe_tokenizer import EOS_TOKEN_ID, bpe_tokenizer
from pdserve.client import PdserveClient
from pdserve.launcher import HOST, LocalCluster, free_port, start_service, wait_serving
from shared.engine.model.loader import load_model, save_pretrained
from shared.engine.request import FinishReason
from split_cluster import assert_all_blocks_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_MODEL_LEN = 256
PROMPT = [17, 901, 33, 2048, 77, 5, 1200, 64, 9]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    save_pretrained(load_model("tiny", seed=0), path)
    bpe_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def systems(model_dir, tmp_path_factory):
    """(router address, colocated address, cluster)."""
    logs = tmp_path_factory.mktemp("sampling-logs")
    model_args = ["--model", str(model_dir), "--block-size", "16", "--num-blocks", "256",
                  "--max-model-len", str(MAX_MODEL_LEN)]
    port = free_port()
    colocated = start_service("colocated", "colocated_svc", ["--host", HOST, "--port", str(port), *model_args],
                              address=f"{HOST}:{port}", log_dir=logs, env={"OMP_NUM_THREADS": "1"})
    try:
        # Four processes load at once (and may wait on a kernel build): a generous start deadline.
        with LocalCluster.start(pod_args=model_args, router_args=["--tokenizer", str(model_dir)],
                                log_dir=logs, timeout_s=300) as cluster:
            wait_serving(colocated, timeout_s=300)
            yield cluster.by_name("router").address, colocated.address, cluster
    finally:
        colocated.stop()


def _run(address: str, prompt=PROMPT, **sampling) -> dict[int, dict]:
    """Per completion index: tokens, text, logprobs, finish reason and stop string."""
    completions: dict[int, dict] = {}
    with PdserveClient(address) as client:
        for chunk in client.generate(prompt, timeout=120, **sampling):
            entry = completions.setdefault(
                chunk.index, {"tokens": [], "text": "", "logprobs": [], "finish": None, "stop": ""}
            )
            entry["tokens"] += chunk.token_ids
            entry["text"] += chunk.text
            entry["logprobs"] += chunk.logprobs
            entry["finish"] = chunk.finish_reason or entry["finish"]
            entry["stop"] = chunk.stop_string or entry["stop"]
    return completions


def _both(systems, **sampling) -> tuple[dict, dict]:
    router, colocated, cluster = systems
    split = _run(router, **sampling)
    whole = _run(colocated, **sampling)
    assert_all_blocks_free(cluster)
    return split, whole


def _assert_same(split: dict, whole: dict) -> None:
    assert split.keys() == whole.keys()
    for index in split:
        a, b = split[index], whole[index]
        assert (a["tokens"], a["text"], a["finish"], a["stop"]) == (b["tokens"], b["text"], b["finish"], b["stop"])
        assert len(a["logprobs"]) == len(b["logprobs"])
        for x, y in zip(a["logprobs"], b["logprobs"]):
            # Same tokens; values agree up to float32 rounding (prefill and decode shape the matmuls differently).
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)



def test_stop_string_across_token_boundaries(systems):
    router, _, _ = systems
    [free] = _run(router, max_tokens=12, ignore_eos=True).values()
    tokenizer = bpe_tokenizer()
    # A stop string from the middle of token 3 to the middle of token 5 of the greedy output: it
    # completes only with token 5, which is decoded on the decode pod.
    texts = [tokenizer.decode(free["tokens"][:i]) for i in range(1, 13)]
    start, end = len(texts[2]) - 2, len(texts[4]) - 1
    stop = texts[-1][start:end]
    assert len(stop) >= 3 and stop not in texts[3]
    for include in (False, True):
        split, whole = _both(systems, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        _assert_same(split, whole)
        [result] = split.values()
        assert result["finish"] is FinishReason.STOP and result["stop"] == stop
        assert result["tokens"] == free["tokens"][:5], "the token that completed the stop is the last one"
        assert result["text"] == texts[-1][:end if include else start]


@pytest.mark.parametrize("options", [
    dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4, ignore_eos=True),
    dict(min_tokens=5, logit_bias={EOS_TOKEN_ID: 40.0, 300: 3.0}),
    dict(temperature=0.9, top_p=0.9, seed=1234, frequency_penalty=0.5),
    dict(logprobs=3, temperature=1.0, seed=99),
    dict(temperature=1.5, min_p=0.2, top_k=50, seed=7),
])
def test_penalties_bias_logprobs_and_seeds_match_colocated(systems, options):
    split, whole = _both(systems, max_tokens=10, **options)
    _assert_same(split, whole)
    [result] = split.values()
    if "min_tokens" in options:  # EOS is pushed up, yet held back until min_tokens
        assert len(result["tokens"]) == 6 and result["tokens"][-1] == EOS_TOKEN_ID
    if "logprobs" in options:
        assert len(result["logprobs"]) == len(result["tokens"])
        assert all(len(entry.top) == 3 for entry in result["logprobs"])


def test_n_completions_match_colocated(systems):
    split, whole = _both(systems, max_tokens=6, ignore_eos=True, n=3, temperature=1.0, seed=5)
    _assert_same(split, whole)
    assert sorted(split) == [0, 1, 2]
    assert len({tuple(c["tokens"]) for c in split.values()}) > 1, "derived seeds differ per completion"
    [single] = _run(systems[0], max_tokens=6, ignore_eos=True, temperature=1.0, seed=6).values()
    assert single["tokens"] == split[1]["tokens"], "completion i samples with seed + i"


def test_json_schema_output_parses_and_validates(systems):
    for options in (dict(), dict(temperature=1.0, seed=3)):
        split, whole = _both(systems, max_tokens=40, json_schema=SCHEMA, **options)
        _assert_same(split, whole)
        [result] = split.values()
        assert result["finish"] is FinishReason.STOP
        jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_bad_options_get_invalid_argument(systems):
    router, colocated, _ = systems
    for address in (router, colocated):
        with PdserveClient(address) as client:
            with pytest.raises(grpc.RpcError) as caught:
                list(client.generate(PROMPT, max_tokens=MAX_MODEL_LEN, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "maximum context length" in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:
                list(client.generate(PROMPT, max_tokens=4, json_schema="{not json", timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "json_schema is not valid JSON" in caught.value.details()


def test_a_stop_string_frees_the_colocated_request_at_once():
    """The engine would go on to max_tokens; the stop string ends the request in the engine too."""
    import asyncio

    from test_colocated import collect, request, serving

    async def run():
        async with serving(bpe_tokenizer()) as (stub, pod, _):
            idle_free = pod.load_report().num_free_blocks
            free = await collect(stub, request(PROMPT, max_tokens=12, ignore_eos=True))
            text = "".join(chunk.text for chunk in free)
            stop = text[3:6]
            stopped = await collect(stub, request(PROMPT, max_tokens=480, ignore_eos=True, stop=[stop]))
            assert stopped[-1].stop_string == stop and "".join(c.text for c in stopped) == text[:text.find(stop)]
            # Far less than the 470-odd further tokens the engine would otherwise decode.
            deadline = time.monotonic() + 0.5
            while pod.loop.num_in_flight or pod.load_report().num_free_blocks != idle_free:
                assert time.monotonic() < deadline, "the stopped request still holds blocks"
                await asyncio.sleep(0.01)

    asyncio.run(run())


def _prompt_logprobs(address: str, **sampling) -> dict[int, list]:
    """Per completion index: the prompt logprobs its chunks carried (only its first one has any)."""
    found: dict[int, list] = {}
    with PdserveClient(address) as client:
        for chunk in client.generate(PROMPT, timeout=120, max_tokens=3, **sampling):
            if chunk.index in found:
                assert not chunk.prompt_logprobs, "prompt logprobs come once, with the first chunk"
            else:
                found[chunk.index] = chunk.prompt_logprobs
    return found


def test_prompt_logprobs_split_decode_only_and_colocated_match_the_engine(systems, model_dir, tmp_path):
    """The prompt's logprobs reach the client with token 1 from the prefill pod (split), from a decode pod
    that computes the prompt itself (decode-only), and from the colocated server; all equal the offline
    engine's, also for a prompt the pods have cached, and for every one of n completions."""
    from shared.engine.llm_engine import LLMEngine
    from shared.engine.request import SamplingParams
    from shared.engine.sched_config import CacheConfig, SchedulerConfig

    router, colocated, cluster = systems
    engine = LLMEngine(model_dir, SchedulerConfig(max_model_len=MAX_MODEL_LEN),
                       CacheConfig(block_size=16, num_blocks=32))
    [expected] = engine.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))
    expected = expected.prompt_logprobs[1:]
    assert len(expected) == len(PROMPT) - 1
    decode_only = _router_computing_prompts_on_decode(cluster, model_dir, tmp_path)
    try:
        for address in (router, decode_only.address, colocated, router):  # router twice: the prompt is cached
            for entries in _prompt_logprobs(address, prompt_logprobs=2, n=2, temperature=1.0, seed=1).values():
                _assert_close(entries, expected)
    finally:
        decode_only.stop()
    assert_all_blocks_free(cluster)


def _router_computing_prompts_on_decode(cluster: LocalCluster, model_dir, log_dir):
    port = free_port()
    router = start_service("router-decode-only", "router", [
        "--host", HOST, "--port", str(port), "--prefill", cluster.by_name("prefill-0").address,
        "--decode", cluster.by_name("decode-0").address, "--tokenizer", str(model_dir),
        "--local-prefill-below", str(MAX_MODEL_LEN)], address=f"{HOST}:{port}", log_dir=log_dir)
    wait_serving(router, timeout_s=120)
    return router


def _assert_close(entries, expected) -> None:
    assert [(e.token_id, [t for t, _ in e.top]) for e in entries] == \
        [(e.token_id, [t for t, _ in e.top]) for e in expected]
    for got, want in zip(entries, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
