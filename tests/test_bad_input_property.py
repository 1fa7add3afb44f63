"""Generated input against the real split system (hypothesis): over 500 requests across Generate,
Prefill, Decode and ReleaseKv, forged and stolen KV handles included. Each ends with INVALID_ARGUMENT,
another fitting status, or a correct result (equal to the single-process engine's when deterministic);
afterwards every pod is SERVING and nothing is left in flight or held (read from the pods' metrics)."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proto.pdserve.v1 import (
    common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc,
)
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.wire.common import sampling_params_from_proto
from split_cluster import BLOCK_SIZE, NUM_BLOCKS, VOCAB_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NUM_EXAMPLES = 520
UINT32_MAX = 2**32 - 1
# Statuses that refuse bad input; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, ...) is a defect.
FITTING_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,  # the input is wrong
    grpc.StatusCode.PERMISSION_DENIED,  # a KV handle no prefill pod of this deployment minted
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # admission limits
}
_ids = itertools.count()
# (kind of call, how it ended) -> count, printed after the run.
_outcomes: collections.Counter = collections.Counter()

# ---- strategies --------------------------------------------------------------------------------

in_vocabulary = st.integers(0, VOCAB_SIZE - 1)
token_id = st.one_of(in_vocabulary, in_vocabulary, st.integers(VOCAB_SIZE, UINT32_MAX))  # 2 in 3 in vocabulary
prompt = st.one_of(
    st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=40),  # mostly well formed
    st.lists(token_id, max_size=40),  # empty, or out-of-vocabulary ids
    st.integers(2040, 2060).map(lambda n: [7] * n),  # at or past the model's maximum length
)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(0, 6)),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), st.just(UINT32_MAX)), max_size=3),
    temperature=st.one_of(st.just(0.0), st.just(0.0), floats, st.floats(0.1, 2.0)),
    top_k=st.one_of(st.just(0), st.integers(0, UINT32_MAX)),
    top_p=st.one_of(st.none(), floats, st.floats(0.05, 1.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 30), st.just(UINT32_MAX)),
).map(lambda message: message if message.max_tokens is not None else _without_max_tokens(message))
request_id = st.one_of(st.just(""), st.text(min_size=1, max_size=12), st.text(min_size=300, max_size=600))
forged_handle = st.builds(
    common_pb2.KvHandle,
    engine_id=st.one_of(st.just(""), st.text(max_size=20)),
    source_address=st.one_of(st.just(""), st.just("127.0.0.1:1"), st.text(max_size=20)),
    block_ids=st.lists(st.integers(0, UINT32_MAX), max_size=6) | st.lists(st.integers(0, NUM_BLOCKS), max_size=6),
    num_tokens=st.integers(0, 100),
    block_size=st.sampled_from([0, 1, BLOCK_SIZE, 1000]),
    layout=st.builds(common_pb2.KvLayout, model_name=st.sampled_from(["tiny@0", "x"]), dtype=st.just("float32"),
                     num_layers=st.just(4), num_kv_heads=st.just(4), head_dim=st.just(32),
                     block_size=st.sampled_from([BLOCK_SIZE, 8])),
    lease_deadline_unix_ms=st.integers(0, 2**64 - 1),
    prompt_digest=st.binary(max_size=40),
    signature=st.binary(max_size=40),
)


def _without_max_tokens(message: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    message.ClearField("max_tokens")  # the server default (16)
    return message


def _unique(request_id_text: str) -> str:
    return f"{request_id_text}#{next(_ids)}" if request_id_text else ""


# ---- the calls ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Stubs:
    generate: generate_pb2_grpc.GenerateServiceStub
    prefill: prefill_pb2_grpc.PrefillServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub


@pytest.fixture(scope="module")
def stubs(split_cluster):
    names = ("router", "prefill-0", "decode-0")
    channels = [grpc.insecure_channel(split_cluster.by_name(name).address) for name in names]
    yield Stubs(generate_pb2_grpc.GenerateServiceStub(channels[0]), prefill_pb2_grpc.PrefillServiceStub(channels[1]),
                decode_pb2_grpc.DecodeServiceStub(channels[2]))
    for channel in channels:
        channel.close()


@pytest.fixture(scope="module")
def reference():
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return LLMEngine("tiny", SchedulerConfig(max_model_len=2048), cache)


def _refused(call, kind: str = "") -> grpc.RpcError | None:
    """None when call() succeeded; the error when it ended with a fitting refusal (else the test fails)."""
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in FITTING_REFUSALS, f"{error.code()}: {error.details()}"
        assert error.details(), "a refusal must say what is wrong"
        _outcomes[kind, error.code().name] += 1
        return error
    _outcomes[kind, "OK"] += 1
    return None


def _expected(reference, prompt_ids: list[int], message: common_pb2.SamplingParams) -> list[int] | None:
    """The single-process engine's tokens when the request is deterministic (greedy or seeded)."""
    params = sampling_params_from_proto(message)
    if not params.is_greedy and params.seed is None:
        return None
    return reference.generate([prompt_ids], params)[0].token_ids


def _check_generate(stubs, reference, prompt_ids, message, rid):
    request = generate_pb2.GenerateRequest(request_id=rid, token_ids=generate_pb2.TokenIds(ids=prompt_ids),
                                           sampling=message)
    tokens: list[int] = []
    if _refused(lambda: tokens.extend(t for m in stubs.generate.Generate(request, timeout=60) for t in m.token_ids),
                "Generate"):
        return
    want = _expected(reference, prompt_ids, message)
    assert want is None or tokens == want
    assert all(t < VOCAB_SIZE for t in tokens)


def _check_prefill(stubs, reference, prompt_ids, message, rid):
    request = prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=message)
    answers = []
    if _refused(lambda: answers.append(stubs.prefill.Prefill(request, timeout=60)), "Prefill"):
        return
    answer = answers[0]
    want = _expected(reference, prompt_ids, message)
    assert want is None or answer.first_token_id == want[0]
    if answer.HasField("handle"):  # nobody pulls it: abandon the hold
        release = prefill_pb2.ReleaseKvRequest(request_id=rid, engine_id=answer.handle.engine_id)
        assert stubs.prefill.ReleaseKv(release, timeout=10).intact is False


def _check_decode(stubs, reference, prompt_ids, generated, message, rid, handle):
    request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, generated_token_ids=generated,
                                       sampling=message, handle=handle)
    tokens: list[int] = []
    if _refused(lambda: tokens.extend(t for m in stubs.decode.Decode(request, timeout=60) for t in m.token_ids),
                "Decode" if handle is None else "Decode (forged handle)"):
        return
    assert handle is None, "a forged handle must never be accepted"
    params = sampling_params_from_proto(message)
    if len(generated) == params.max_tokens:
        assert tokens == []  # already complete: answered LENGTH with nothing to decode
    elif params.is_greedy:
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - len(generated))
        assert tokens == reference.generate([prompt_ids + generated], rest)[0].token_ids


def _check_release(stubs, rid, engine_id, digest):
    request = prefill_pb2.ReleaseKvRequest(request_id=rid, engine_id=engine_id, prompt_digest=digest)
    answers = []
    if _refused(lambda: answers.append(stubs.prefill.ReleaseKv(request, timeout=10)), "ReleaseKv"):
        return
    assert answers[0].intact is False  # no hold of these exists


def _check_stolen(stubs, reference, victim, thief, first_index):
    """A real handle, replayed with another prompt or tampered, then used honestly."""
    message = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    rid = _unique("victim")
    answer = stubs.prefill.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=victim,
                                                              sampling=message), timeout=60)
    handle = answer.handle
    tampered = common_pb2.KvHandle()
    tampered.CopyFrom(handle)
    tampered.block_ids[first_index % len(tampered.block_ids)] += 1
    for forged_prompt, forged in ((thief, handle), (victim, tampered)):
        request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=forged_prompt,
                                           generated_token_ids=[answer.first_token_id], sampling=message,
                                           handle=forged)
        error = _refused(lambda: list(stubs.decode.Decode(request, timeout=60)), "Decode (stolen handle)")
        assert error is not None and error.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                      grpc.StatusCode.PERMISSION_DENIED)
    honest = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=victim,
                                      generated_token_ids=[answer.first_token_id], sampling=message, handle=handle)
    messages = list(stubs.decode.Decode(honest, timeout=60))
    # The refused replays left the hold intact (an earlier example may have cached the same prompt).
    usable = (decode_pb2.KV_PULL_OUTCOME_PULLED, decode_pb2.KV_PULL_OUTCOME_PREFIX_CACHE_HIT)
    assert messages[0].kv_pull.outcome in usable
    tokens = [answer.first_token_id] + [t for m in messages for t in m.token_ids]
    assert tokens == reference.generate([victim], sampling_params_from_proto(message))[0].token_ids


# ---- the property ------------------------------------------------------------------------------

same_length_prompts = st.integers(1, 48).flatmap(lambda n: st.tuples(
    st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=n, max_size=n),
    st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=n, max_size=n),
)).filter(lambda pair: pair[0] != pair[1])

case = st.one_of(
    st.tuples(st.just("generate"), prompt, sampling, request_id),
    st.tuples(st.just("prefill"), prompt, sampling, request_id),
    st.tuples(st.just("decode"), prompt, st.lists(token_id, max_size=3), sampling, request_id,
              st.one_of(st.none(), forged_handle)),
    st.tuples(st.just("release"), request_id, st.text(max_size=20), st.binary(max_size=40)),
    st.tuples(st.just("stolen"), same_length_prompts, st.integers(0, 10)),
)


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(case=case)
def _every_request_is_refused_or_correct(stubs, reference, case):
    kind, *rest = case
    if kind == "generate":
        prompt_ids, message, rid = rest
        _check_generate(stubs, reference, prompt_ids, message, _unique(rid))
    elif kind == "prefill":
        prompt_ids, message, rid = rest
        _check_prefill(stubs, reference, prompt_ids, message, _unique(rid))
    elif kind == "decode":
        prompt_ids, generated, message, rid, handle = rest
        _check_decode(stubs, reference, prompt_ids, generated, message, _unique(rid), handle)
    elif kind == "release":
        rid, engine_id, digest = rest
        _check_release(stubs, _unique(rid), engine_id, digest)
    else:
        (victim, thief), first_index = rest
        _check_stolen(stubs, reference, victim, thief, first_index)
    _every_request_is_refused_or_correct.num_calls += 1


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def _is_idle(cluster) -> bool:
    for name in ("prefill-0", "decode-0"):
        values = _scrape(cluster.by_name(name).metrics_url)
        in_use = ("pdserve_kv_blocks_used", "pdserve_kv_blocks_held_for_peer", "pdserve_queue_depth",
                  "pdserve_running_requests")
        if any(values[metric] != 0.0 for metric in in_use):
            return False
    return True


def test_generated_requests_are_refused_or_answered_correctly_and_leave_nothing_behind(split_cluster, stubs,
                                                                                       reference):
    _every_request_is_refused_or_correct.num_calls = 0
    _every_request_is_refused_or_correct(stubs, reference)
    assert _every_request_is_refused_or_correct.num_calls >= 500
    print("\n".join(f"{kind:24s} {code:20s} {n}" for (kind, code), n in sorted(_outcomes.items())))
    for service in split_cluster.services:
        with grpc.insecure_channel(service.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service.name
    deadline = time.monotonic() + 10.0
    while not _is_idle(split_cluster):
        assert time.monotonic() < deadline, "blocks or requests left behind"
        time.sleep(0.2)
