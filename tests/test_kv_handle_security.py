"""KV handles against the real split system: a stolen handle replayed with another prompt is refused and
poisons nothing, a forged, unsigned or tampered handle is refused before any READ (the decode pod's
transfer-bytes metric does not move), a genuine handle is READ once and only while its hold stands (a
replay reads nothing, the READ counter shows it), a confirmation for another prompt is not intact, and malformed
request bytes get INVALID_ARGUMENT on every method of every server."""
from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import PdserveClient
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, prefill_pb2, prefill_pb2_grpc
from raw_grpc import GARBAGE, call_with_raw_bytes
from shared.engine.kv_cache.hashing import prompt_digest
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.wire.common import sampling_params_to_proto
from shared.serving.wire.prefill import prefill_request_to_proto
from shared.serving.server.handle_key import KEY_ENV_VAR
from split_cluster import BLOCK_SIZE, NUM_BLOCKS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SAMPLING = dict(max_tokens=8, ignore_eos=True)


@pytest.fixture
def cluster(split_cluster):
    return split_cluster


@pytest.fixture(scope="module")
def reference():
    """The single-process engine on the same weights."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return LLMEngine("tiny", SchedulerConfig(max_model_len=2048), cache)


def _prompt(seed: int, length: int = 50) -> list[int]:
    # Seeds of this module's own: the session's other tests must not find these prompts in a prefix cache.
    rng = random.Random(f"kv-handle-security-{seed}")
    return [rng.randrange(3, 4096) for _ in range(length)]


def _expected(reference, prompt: list[int]) -> list[int]:
    return reference.generate([prompt], SamplingParams(**SAMPLING))[0].token_ids


def _prefill(cluster, request_id: str, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        request = prefill_request_to_proto(request_id, prompt, SamplingParams(**SAMPLING))
        return prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=30)


def _decode(cluster, request_id: str, prompt: list[int], first_token: int, handle) -> list[decode_pb2.DecodeResponse]:
    request = decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, generated_token_ids=[first_token],
        sampling=sampling_params_to_proto(SamplingParams(**SAMPLING)), handle=handle,
    )
    with grpc.insecure_channel(cluster.by_name("decode-0").address) as channel:
        return list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=30))


def _release(cluster, request_id: str, engine_id: str, digest: bytes = b"") -> bool:
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        request = prefill_pb2.ReleaseKvRequest(request_id=request_id, engine_id=engine_id, prompt_digest=digest)
        return prefill_pb2_grpc.PrefillServiceStub(channel).ReleaseKv(request, timeout=10).intact


def _generate(cluster, prompt: list[int]) -> list[int]:
    with PdserveClient(cluster.router.address) as client:
        return [t for chunk in client.generate(prompt, timeout=60, **SAMPLING) for t in chunk.token_ids]


def _decode_counter(cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.by_name("decode-0").metrics_url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        sample.value for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.name == name
    )


def _transfer_bytes(cluster) -> float:
    """What the decode pod's pulls have read so far (its Prometheus counter)."""
    return _decode_counter(cluster, "pdserve_kv_transfer_bytes_total")


def _reads(cluster) -> float:
    """The NIXL READs the decode pod has posted so far, their data used or not."""
    return _decode_counter(cluster, "pdserve_kv_reads_total")


def _held_blocks(cluster) -> int:
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        load = prefill_pb2_grpc.PrefillServiceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5).load
    return load.num_held_blocks


def _wait_until_nothing_is_held(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _held_blocks(cluster) != 0:
        assert time.monotonic() < deadline, "prefill still holds blocks"
        time.sleep(0.1)


def _decode_error(cluster, request_id, prompt, first_token, handle) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        _decode(cluster, request_id, prompt, first_token, handle)
    return error.value


def test_stolen_handle_replayed_with_another_prompt_is_refused_and_poisons_nothing(cluster, reference):
    victim, thief = _prompt(1), _prompt(2)  # same length: only the tokens differ
    answer = _prefill(cluster, "victim-1", victim)
    read_before = _transfer_bytes(cluster)
    error = _decode_error(cluster, "victim-1", thief, answer.first_token_id, answer.handle)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another prompt" in error.details()
    assert _transfer_bytes(cluster) == read_before  # refused before any READ
    # The refused replay did not end the hold: the honest request still pulls it, and is correct.
    messages = _decode(cluster, "victim-1", victim, answer.first_token_id, answer.handle)
    assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
    assert [answer.first_token_id] + [t for m in messages for t in m.token_ids] == _expected(reference, victim)
    assert _transfer_bytes(cluster) > read_before
    # Nothing entered the decode pod's prefix cache under the thief's prompt: both are correct end to end.
    assert _generate(cluster, thief) == _expected(reference, thief)
    assert _generate(cluster, victim) == _expected(reference, victim)
    _wait_until_nothing_is_held(cluster)


def _recomputed_tokens(messages, answer) -> list[int]:
    assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED
    return [answer.first_token_id] + [t for m in messages for t in m.token_ids]


def test_a_replayed_handle_reads_nothing_once_its_hold_was_abandoned(cluster, reference):
    """What a router does for a cancelled call (ReleaseKv without a digest) ends the hold; the genuine
    handle, replayed within its lease under a new request id or its own, makes the decode pod READ nothing
    (its blocks may belong to another request by then): the prompt is recomputed, the tokens are right."""
    prompt = _prompt(20)
    answer = _prefill(cluster, "abandoned-1", prompt)
    assert _release(cluster, "abandoned-1", answer.handle.engine_id) is False  # abandoned
    _wait_until_nothing_is_held(cluster)
    other = _prefill(cluster, "bystander-1", _prompt(21))  # a live hold, maybe on the freed blocks
    reads_before, bytes_before = _reads(cluster), _transfer_bytes(cluster)
    for replay_id in ("replayed-1", "abandoned-1"):
        messages = _decode(cluster, replay_id, prompt, answer.first_token_id, answer.handle)
        assert _recomputed_tokens(messages, answer) == _expected(reference, prompt)
    time.sleep(0.6)  # a READ would show in the counters within one gauge refresh
    assert (_reads(cluster), _transfer_bytes(cluster)) == (reads_before, bytes_before)
    assert _release(cluster, "bystander-1", other.handle.engine_id) is False
    _wait_until_nothing_is_held(cluster)


def test_a_handle_is_read_once_and_a_replay_under_another_id_leaves_the_hold_to_its_request(cluster, reference):
    prompt = _prompt(22)
    answer = _prefill(cluster, "once-1", prompt)
    reads_before, bytes_before = _reads(cluster), _transfer_bytes(cluster)
    # The hold is live, but not this request's: refused before any READ, and the hold stays.
    replayed = _decode(cluster, "thief-1", prompt, answer.first_token_id, answer.handle)
    assert _recomputed_tokens(replayed, answer) == _expected(reference, prompt)
    time.sleep(0.6)
    assert (_reads(cluster), _transfer_bytes(cluster)) == (reads_before, bytes_before)
    # Its own request pulls it: one READ, its bytes counted.
    messages = _decode(cluster, "once-1", prompt, answer.first_token_id, answer.handle)
    assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
    assert [answer.first_token_id] + [t for m in messages for t in m.token_ids] == _expected(reference, prompt)
    assert _reads(cluster) == reads_before + 1
    assert _transfer_bytes(cluster) == bytes_before + messages[0].kv_pull.num_bytes > bytes_before
    _wait_until_nothing_is_held(cluster)


def test_confirmation_for_another_prompt_is_not_intact(cluster):
    prompt = _prompt(3)
    answer = _prefill(cluster, "confirm-1", prompt)
    other = prompt_digest(_prompt(4), BLOCK_SIZE)
    assert _release(cluster, "confirm-1", answer.handle.engine_id, other) is False
    _wait_until_nothing_is_held(cluster)
    answer = _prefill(cluster, "confirm-2", prompt)
    assert _release(cluster, "confirm-2", answer.handle.engine_id, prompt_digest(prompt, BLOCK_SIZE)) is True
    _wait_until_nothing_is_held(cluster)


def test_a_release_without_an_engine_id_ends_the_current_engines_hold(cluster):
    """What a router sends when its Prefill call ended (deadline, cancel) as the answer was on its way."""
    prompt = _prompt(5)
    answer = _prefill(cluster, "unclaimed-1", prompt)
    assert answer.HasField("handle") and _held_blocks(cluster) > 0
    assert _release(cluster, "unclaimed-1", "", prompt_digest(prompt, BLOCK_SIZE)) is True
    _wait_until_nothing_is_held(cluster, timeout_s=1.0)
    answer = _prefill(cluster, "unclaimed-2", prompt)
    assert _release(cluster, "unclaimed-2", "another-engine") is False  # a named engine must match
    assert _held_blocks(cluster) > 0
    assert _release(cluster, "unclaimed-2", "") is False  # abandoned: ends the hold, nothing pulled is good
    _wait_until_nothing_is_held(cluster, timeout_s=1.0)


def _tampered(handle: common_pb2.KvHandle, **changes) -> common_pb2.KvHandle:
    forged = common_pb2.KvHandle()
    forged.CopyFrom(handle)
    for name, value in changes.items():
        if name == "block_ids":
            del forged.block_ids[:]
            forged.block_ids.extend(value)
        else:
            setattr(forged, name, value)
    return forged


TAMPERINGS = {
    # Other requests' blocks, in range of the pool: what a reader of other memory would ask for.
    "other block ids": lambda h: dict(block_ids=[b + 7 for b in h.block_ids]),
    "no signature": lambda h: dict(signature=b""),
    "random signature": lambda h: dict(signature=random.Random(5).randbytes(32)),
    "longer lease": lambda h: dict(lease_deadline_unix_ms=h.lease_deadline_unix_ms + 60_000),
    "digest of the thief's prompt": lambda h: dict(prompt_digest=b"\x01" * 32),
}


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_forged_or_tampered_handle_is_refused_before_any_read(cluster, tampering):
    prompt = _prompt(10)
    answer = _prefill(cluster, f"forged-{len(tampering)}", prompt)
    forged = _tampered(answer.handle, **TAMPERINGS[tampering](answer.handle))
    read_before = _transfer_bytes(cluster)
    error = _decode_error(cluster, f"forged-{len(tampering)}", prompt, answer.first_token_id, forged)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert "signature does not verify" in error.details()
    time.sleep(0.6)  # a READ would show in the counter within one gauge refresh
    assert _transfer_bytes(cluster) == read_before
    assert _release(cluster, f"forged-{len(tampering)}", answer.handle.engine_id) is False  # abandon the hold
    _wait_until_nothing_is_held(cluster)
    # The decode pod says so in its log (a key that differs between the pods shows there, not only to clients).
    assert "does not verify under this pod's key" in cluster.by_name("decode-0").log_tail(1_000_000)


def _methods(service_name: str, module) -> list[tuple[str, bool, bool]]:
    """(path, streams its response, streams its request) of every method of a generated service."""
    service = module.DESCRIPTOR.services_by_name[service_name]
    return [(f"/{service.full_name}/{m.name}", m.server_streaming, m.client_streaming) for m in service.methods]


def _every_method() -> dict[str, list[tuple[str, bool, bool]]]:
    common = [
        ("/grpc.health.v1.Health/Check", False, False),
        ("/grpc.health.v1.Health/Watch", True, False),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True),
    ]
    return {
        "router": _methods("GenerateService", generate_pb2) + common,
        "prefill-0": _methods("PrefillService", prefill_pb2) + common,
        "decode-0": _methods("DecodeService", decode_pb2) + common,
    }


def test_malformed_bytes_get_invalid_argument_on_every_method_of_every_server(cluster):
    methods = _every_method()
    assert {m for m, _, _ in methods["prefill-0"]} >= {
        "/pdserve.v1.PrefillService/Prefill", "/pdserve.v1.PrefillService/ReleaseKv",
        "/pdserve.v1.PrefillService/GetKvSource", "/pdserve.v1.PrefillService/GetLoad",
    }

    async def scenario():
        for name, service_methods in methods.items():
            async with grpc.aio.insecure_channel(cluster.by_name(name).address) as channel:
                for method, is_stream_response, is_stream_request in service_methods:
                    error = await call_with_raw_bytes(channel, method, is_stream_response, is_stream_request, GARBAGE)
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, method, error.details())
                    assert "malformed request message" in error.details()

    asyncio.run(scenario())
    assert all(service.is_running() for service in cluster.services)
    for name in methods:
        log = cluster.by_name(name).log_tail(1_000_000)
        # One warning line per call, no traceback of grpc's own failed deserialization.
        assert log.count("malformed request to") >= len(methods[name]), name
        assert "DecodeError" not in log and "Exception deserializing" not in log, name


@pytest.mark.parametrize("module", ["prefill_svc", "decode_svc"])
def test_a_split_pod_without_a_handle_key_refuses_to_start(module):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV_VAR}
    done = subprocess.run([sys.executable, "-m", module, "--port", "0"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode != 0
    assert "no KV handle key" in done.stderr and "--insecure-unsigned-handles" in done.stderr
