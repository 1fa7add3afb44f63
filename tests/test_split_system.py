"""The split system as three OS processes on 127.0.0.1: router -> prefill -> NIXL pull -> decode.

Outputs must equal the single-process engine's, the KV must really cross processes, and every block
must be free again afterwards on both pods.
"""
from __future__ import annotations

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import PdserveClient
from pdserve.launcher import free_port, start_service, wait_serving
from proto.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from shared.serving.wire.common import finish_reason_from_proto, sampling_params_to_proto
from shared.serving.wire.prefill import prefill_request_to_proto
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import FinishReason, SamplingParams, StructuredOutputSpec
from split_cluster import (
    BLOCK_SIZE, BYTES_PER_BLOCK, LEASE_S, MODEL_ARGS, NUM_BLOCKS, assert_all_blocks_free, load_report,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(split_cluster):
    return split_cluster


@pytest.fixture(scope="module")
def reference():
    """The single-process engine on the same weights."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return LLMEngine("tiny", SchedulerConfig(max_model_len=2048), cache)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(rng.randrange(3, 120))] for _ in range(num)]


def _generate(address: str, prompt: list[int], **sampling) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    with PdserveClient(address) as client:
        for chunk in client.generate(prompt, timeout=60, **sampling):
            tokens.extend(chunk.token_ids)
            reason = chunk.finish_reason or reason
    return tokens, reason



def test_greedy_outputs_match_the_single_process_engine(cluster, reference):
    prompts = _prompts(16, seed=1)
    max_tokens = [random.Random(i).randrange(2, 24) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda args: _generate(cluster.router.address, args[0], max_tokens=args[1], ignore_eos=True),
            zip(prompts, max_tokens),
        ))
    expected = reference.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    for (tokens, reason), want in zip(results, expected):
        assert tokens == want.token_ids
        assert reason == want.finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(cluster)


def test_seeded_sampling_matches_the_single_process_engine(cluster, reference):
    prompts = _prompts(6, seed=2)
    params = dict(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95)
    seeds = [11, 12, 13, 14, 15, 16]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda args: _generate(cluster.router.address, args[0], seed=args[1], **params)[0],
            zip(prompts, seeds),
        ))
    expected = reference.generate(prompts, [SamplingParams(seed=seed, **params) for seed in seeds])
    assert results == [want.token_ids for want in expected]
    assert len({tuple(tokens) for tokens in results}) > 1


def _prefill(cluster, request_id: str, prompt: list[int], **sampling) -> prefill_pb2.PrefillResponse:
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        request = prefill_request_to_proto(request_id, prompt, SamplingParams(**sampling))
        return prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=30)


def _decode(cluster, request_id: str, prompt: list[int], answer, **sampling) -> list[decode_pb2.DecodeResponse]:
    request = decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        generated_token_ids=[answer.first_token_id],
        sampling=sampling_params_to_proto(SamplingParams(**sampling)),
        handle=answer.handle,
    )
    with grpc.insecure_channel(cluster.by_name("decode-0").address) as channel:
        return list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=30))


def test_pods_called_directly_end_a_sequence_at_the_model_length(cluster, reference):
    """The length rule is the edge's (router, colocated server): a prefill and a decode pod called directly
    with max_tokens past the model's length run the request and end it there, as their engines do."""
    prompt = [random.Random(5).randrange(3, 4096) for _ in range(2040)]  # tiny's model length: 2048
    sampling = dict(max_tokens=50, ignore_eos=True)
    answer = _prefill(cluster, "past-length", prompt, **sampling)
    messages = _decode(cluster, "past-length", prompt, answer, **sampling)
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert len(prompt) + len(tokens) == 2048
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert tokens == reference.generate([prompt], SamplingParams(**sampling))[0].token_ids
    assert_all_blocks_free(cluster)


def test_kv_really_crosses_processes_and_bytes_match_the_blocks(cluster, reference):
    prompt = [random.Random(3).randrange(3, 4096) for _ in range(75)]  # 5 blocks, the last one partial
    sampling = dict(max_tokens=8, ignore_eos=True)
    answer = _prefill(cluster, "bytes-1", prompt, **sampling)
    assert len(answer.handle.block_ids) == 5
    messages = _decode(cluster, "bytes-1", prompt, answer, **sampling)
    stats = messages[0].kv_pull
    assert stats.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
    assert stats.num_blocks == 5
    assert stats.num_bytes == 5 * BYTES_PER_BLOCK
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert tokens == reference.generate([prompt], SamplingParams(**sampling))[0].token_ids
    assert_all_blocks_free(cluster)


def test_partial_prefix_cache_hit_pulls_only_missing_blocks(cluster, reference):
    shared_prefix = [random.Random(4).randrange(3, 4096) for _ in range(2 * BLOCK_SIZE)]
    first = shared_prefix + [5, 6, 7]
    second = shared_prefix + [random.Random(5).randrange(3, 4096) for _ in range(40)]  # 72 tokens: 5 blocks
    sampling = dict(max_tokens=4, ignore_eos=True)
    answer = _prefill(cluster, "prefix-1", first, **sampling)
    _decode(cluster, "prefix-1", first, answer, **sampling)
    answer = _prefill(cluster, "prefix-2", second, **sampling)
    messages = _decode(cluster, "prefix-2", second, answer, **sampling)
    stats = messages[0].kv_pull
    assert stats.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
    assert stats.num_cached_blocks == 2
    assert stats.num_blocks == 3
    assert stats.num_bytes == 3 * BYTES_PER_BLOCK
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert tokens == reference.generate([second], SamplingParams(**sampling))[0].token_ids
    assert_all_blocks_free(cluster)


def test_expired_lease_frees_prefill_blocks_and_decode_recomputes(cluster, reference):
    prompt = _prompts(1, seed=6)[0] + [9] * 40
    sampling = dict(max_tokens=6, ignore_eos=True)
    answer = _prefill(cluster, "lease-1", prompt, **sampling)
    prefill_address = cluster.by_name("prefill-0").address
    assert load_report(prefill_address, prefill_pb2_grpc.PrefillServiceStub).num_held_blocks == len(answer.handle.block_ids)
    time.sleep(LEASE_S + 0.5)
    load = load_report(prefill_address, prefill_pb2_grpc.PrefillServiceStub)
    assert load.num_held_blocks == 0 and load.num_free_blocks == load.num_total_blocks
    messages = _decode(cluster, "lease-1", prompt, answer, **sampling)
    assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert tokens == reference.generate([prompt], SamplingParams(**sampling))[0].token_ids
    assert_all_blocks_free(cluster)


def test_a_prefill_reusing_a_held_request_id_is_refused_and_leaves_the_hold(cluster, reference):
    # The first request's stream has ended (token 1 went out) but its blocks are held for a decode pod:
    # the engine still knows the id. The second Prefill is refused, and must not end that hold.
    prompt = _prompts(1, seed=21)[0]
    sampling = dict(max_tokens=5, ignore_eos=True)
    answer = _prefill(cluster, "held-twice", prompt, **sampling)
    with pytest.raises(grpc.RpcError) as second:
        _prefill(cluster, "held-twice", prompt, **sampling)
    assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
    messages = _decode(cluster, "held-twice", prompt, answer, **sampling)
    assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert tokens == reference.generate([prompt], SamplingParams(**sampling))[0].token_ids
    assert_all_blocks_free(cluster)


def test_a_constraint_that_fails_while_decoding_is_invalid_argument_on_both_pods(cluster):
    # The regex compiles, but llguidance's lexer gives up once the first token is consumed.
    prompt = _prompts(1, seed=22)[0]
    with pytest.raises(grpc.RpcError) as prefill:
        _prefill(cluster, "lexer-1", prompt, max_tokens=5, structured_output=StructuredOutputSpec(regex="a{1000000}"))
    assert prefill.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured output constraint failed" in prefill.value.details()
    with pytest.raises(grpc.RpcError) as generate:
        _generate(cluster.router.address, prompt, max_tokens=5, regex="a{1000000}")
    assert generate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_all_blocks_free(cluster)


def test_request_ended_by_token_one_never_reaches_decode(cluster):
    decode_address = cluster.by_name("decode-0").address
    answer = _prefill(cluster, "one-1", _prompts(1, seed=7)[0], max_tokens=1)
    assert finish_reason_from_proto(answer.finish_reason) == FinishReason.LENGTH
    assert not answer.HasField("handle")
    before = _decode_requests_seen(cluster)
    tokens, reason = _generate(cluster.router.address, _prompts(1, seed=8)[0], max_tokens=1)
    assert len(tokens) == 1 and reason == FinishReason.LENGTH
    assert _decode_requests_seen(cluster) == before
    assert load_report(decode_address, decode_pb2_grpc.DecodeServiceStub).num_running == 0
    assert_all_blocks_free(cluster)


def _decode_requests_seen(cluster) -> float:
    """Requests the decode pod has finished, by any outcome, from its Prometheus endpoint."""
    with urllib.request.urlopen(cluster.by_name("decode-0").metrics_url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdserve_requests_total"
    )


def test_cancelled_stream_frees_blocks_on_both_pods(cluster):
    prompt = _prompts(1, seed=9)[0]
    cancelled = threading.Event()
    with PdserveClient(cluster.router.address) as client:
        stream = client.generate(prompt, max_tokens=2048 - len(prompt), ignore_eos=True, timeout=60)
        received = 0
        for chunk in stream:
            received += len(chunk.token_ids)
            if received >= 3:
                stream.close()  # leaving the stream cancels the call
                cancelled.set()
                break
    assert cancelled.is_set()
    assert_all_blocks_free(cluster)


def test_a_request_id_already_in_flight_gets_already_exists(cluster):
    # No handle: the decode pod computes the prompt itself and streams many tokens, so the first call
    # is still in flight when the second, with the same id, arrives.
    sampling = sampling_params_to_proto(SamplingParams(max_tokens=1000, ignore_eos=True))
    request = decode_pb2.DecodeRequest(
        request_id="twice", prompt_token_ids=[5, 6, 7], generated_token_ids=[8], sampling=sampling
    )
    with grpc.insecure_channel(cluster.by_name("decode-0").address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        first = stub.Decode(request, timeout=60)
        next(first)
        with pytest.raises(grpc.RpcError) as second:
            list(stub.Decode(request, timeout=30))
        first.cancel()
    assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already in flight" in second.value.details()
    assert_all_blocks_free(cluster)


def test_a_continuation_already_at_max_tokens_is_answered_complete(cluster):
    # A re-issue after a decode pod died right after the last token, before saying so. max_tokens explicit,
    # or unset and filled by the decode pod itself (no checkpoint default here: the fallback).
    prompt, done = [5, 6, 7], [8, 9, 10, 11]
    explicit = SamplingParams(max_tokens=4, ignore_eos=True)
    filled = SamplingParams(max_tokens=4, ignore_eos=True, unset={"max_tokens"})  # travels as fallback_max_tokens
    with grpc.insecure_channel(cluster.by_name("decode-0").address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)

        def decode(generated, params, handle=None, request_id="complete"):
            request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                               generated_token_ids=generated, handle=handle,
                                               sampling=sampling_params_to_proto(params))
            return [(list(m.token_ids), m.finish_reason) for m in stub.Decode(request, timeout=30)]

        for params in (explicit, filled):
            assert decode(done, params) == [([], common_pb2.FINISH_REASON_LENGTH)]
            with pytest.raises(grpc.RpcError) as error:
                decode(done + [12], params)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "5 tokens already generated exceed max_tokens 4" in error.value.details()
        # With a real handle (token 1 already reaches max_tokens 1): nothing pulled, the hold released.
        answer = _prefill(cluster, "complete-handle", prompt, max_tokens=2, ignore_eos=True)
        assert answer.HasField("handle")
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        complete = decode([answer.first_token_id], one, answer.handle, "complete-handle")
        assert complete == [([], common_pb2.FINISH_REASON_LENGTH)]
    assert_all_blocks_free(cluster, timeout_s=LEASE_S / 3)  # released, not left to the lease's end


@pytest.mark.parametrize(
    "prompt,sampling,message",
    [
        ([], {}, "prompt"),
        ([1, 2, 99999], {}, "vocabulary"),
        (list(range(3, 2100)), {}, "maximum context length"),
        ([1, 2, 3], {"temperature": -1.0}, "temperature"),
        ([1, 2, 3], {"top_p": 0.0}, "top_p"),
        ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_input_gets_invalid_argument_and_leaves_nothing_behind(cluster, prompt, sampling, message):
    # Raw messages: the client library would refuse these before sending.
    request = generate_pb2.GenerateRequest(
        request_id="bad", token_ids=generate_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(**sampling)
    )
    with grpc.insecure_channel(cluster.router.address) as channel, pytest.raises(grpc.RpcError) as error:
        list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    assert_all_blocks_free(cluster)
    assert all(service.is_running() for service in cluster.services)


def test_policy_fail_ends_the_request_with_a_clear_status_instead_of_recomputing(cluster, tmp_path):
    port = free_port()
    strict = start_service(
        "decode-fail", "decode_svc",
        ["--host", "127.0.0.1", "--port", str(port), *MODEL_ARGS, "--kv-load-failure-policy", "fail"],
        address=f"127.0.0.1:{port}", log_dir=tmp_path, env=cluster.env,
    )
    try:
        wait_serving(strict)
        prompt = _prompts(1, seed=10)[0] + [8] * 20
        sampling = dict(max_tokens=6, ignore_eos=True)
        answer = _prefill(cluster, "strict-1", prompt, **sampling)
        time.sleep(LEASE_S + 0.5)
        request = decode_pb2.DecodeRequest(
            request_id="strict-1", prompt_token_ids=prompt, generated_token_ids=[answer.first_token_id],
            sampling=sampling_params_to_proto(SamplingParams(**sampling)), handle=answer.handle,
        )
        with grpc.insecure_channel(strict.address) as channel, pytest.raises(grpc.RpcError) as error:
            list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "recomputed_lease_expired" in error.value.details() and "'fail'" in error.value.details()
        with grpc.insecure_channel(strict.address) as channel:
            load = decode_pb2_grpc.DecodeServiceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5).load
        assert load.num_free_blocks == load.num_total_blocks
    finally:
        strict.stop()
