"""Every service's Prometheus endpoint, scraped over HTTP after traffic through the three-process system:
requests by outcome, TTFT/TPOT, KV transfer bytes, lease expiries and the KV block gauges move as they must."""
from __future__ import annotations

import math
import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from shared.serving.wire.common import sampling_params_to_proto
from shared.serving.wire.prefill import prefill_request_to_proto
from shared.engine.request import SamplingParams
from split_cluster import BLOCK_SIZE, BYTES_PER_BLOCK, LEASE_S, VOCAB_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def cluster(split_cluster):
    return split_cluster


class Scrape:
    """One scrape of a /metrics endpoint: sample values by name and labels."""

    def __init__(self, url: str):
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        self.values = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)


def _scrape_all(cluster: LocalCluster) -> dict[str, Scrape]:
    return {name: Scrape(cluster.by_name(name).metrics_url) for name in ("router", "prefill-0", "decode-0")}


def _moved(before: dict[str, Scrape], after: dict[str, Scrape], service: str, name: str, **labels) -> float:
    return after[service].get(name, **labels) - before[service].get(name, **labels)


def _wait_for(cluster: LocalCluster, predicate, timeout_s: float = 10.0) -> dict[str, Scrape]:
    """Scrape until predicate(scrapes) holds (the pods refresh their gauges every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scrapes = _scrape_all(cluster)
        if predicate(scrapes) or time.monotonic() > deadline:
            return scrapes
        time.sleep(0.1)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def _prefill(cluster, request_id: str, prompt: list[int], **sampling):
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        request = prefill_request_to_proto(request_id, prompt, SamplingParams(**sampling))
        return prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=30)


def _decode(cluster, request_id: str, prompt: list[int], first_token_id: int, handle, **sampling):
    request = decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        generated_token_ids=[first_token_id],
        sampling=sampling_params_to_proto(SamplingParams(**sampling)),
        handle=handle,
    )
    with grpc.insecure_channel(cluster.by_name("decode-0").address) as channel:
        return list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=30))


def test_counters_move_with_routed_traffic(cluster):
    rng = random.Random(1)
    before = _scrape_all(cluster)
    lengths = [20, 33, 47, 64]
    with PdserveClient(cluster.router.address) as client:
        for length in lengths:
            chunks = list(client.generate(_prompt(rng, length), max_tokens=6, ignore_eos=True, timeout=60))
            assert sum(len(chunk.token_ids) for chunk in chunks) == 6
    after = _wait_for(cluster, lambda s: _is_idle(cluster, s))
    n = len(lengths)
    assert _moved(before, after, "router", "pdserve_router_requests_total", outcome="ok") == n
    assert _moved(before, after, "router", "pdserve_router_ttft_seconds_count") == n
    assert _moved(before, after, "router", "pdserve_router_kv_pulls_total", outcome="pulled") == n
    for pod in ("prefill-0", "decode-0"):
        assert _moved(before, after, pod, "pdserve_requests_total", outcome="ok") == n
        assert _moved(before, after, pod, "pdserve_requests_total", outcome="cancelled") == 0
        assert _moved(before, after, pod, "pdserve_ttft_seconds_count") == n
        assert _moved(before, after, pod, "pdserve_ttft_seconds_sum") > 0
    assert _moved(before, after, "decode-0", "pdserve_tpot_seconds_count") == n
    assert _moved(before, after, "decode-0", "pdserve_tpot_seconds_sum") > 0
    # Distinct random prompts: every block of every prompt crossed, nothing came from a prefix cache.
    expected_bytes = sum(math.ceil(length / BLOCK_SIZE) for length in lengths) * BYTES_PER_BLOCK
    assert _moved(before, after, "decode-0", "pdserve_kv_transfer_bytes_total") == expected_bytes
    assert _moved(before, after, "decode-0", "pdserve_kv_transfer_seconds_total") > 0
    _assert_idle(cluster, after)


def test_transfer_bytes_equal_what_the_pulls_reported(cluster):
    rng = random.Random(2)
    before = _scrape_all(cluster)
    reported_bytes = 0
    reported_seconds = 0.0
    for index, length in enumerate((17, 75)):
        prompt = _prompt(rng, length)
        answer = _prefill(cluster, f"bytes-{index}", prompt, max_tokens=4, ignore_eos=True)
        messages = _decode(
            cluster, f"bytes-{index}", prompt, answer.first_token_id, answer.handle, max_tokens=4, ignore_eos=True
        )
        assert messages[0].kv_pull.outcome == decode_pb2.KV_PULL_OUTCOME_PULLED
        reported_bytes += messages[0].kv_pull.num_bytes
        reported_seconds += messages[0].kv_pull.seconds
    after = _scrape_all(cluster)
    assert reported_bytes > 0
    assert _moved(before, after, "decode-0", "pdserve_kv_transfer_bytes_total") == reported_bytes
    assert _moved(before, after, "decode-0", "pdserve_kv_transfer_seconds_total") == pytest.approx(
        reported_seconds, rel=1e-6, abs=1e-6
    )


def test_invalid_requests_are_counted_as_invalid(cluster):
    before = _scrape_all(cluster)
    with grpc.insecure_channel(cluster.router.address) as channel:
        with pytest.raises(grpc.RpcError) as empty:
            list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(), timeout=10))
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as out_of_vocab:
        _prefill(cluster, "bad-prefill", [1, 2, VOCAB_SIZE + 5], max_tokens=4)
    assert out_of_vocab.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bad_decode:
        _decode(cluster, "bad-decode", [1, 2, 3], VOCAB_SIZE + 5, None, max_tokens=4)
    assert bad_decode.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = _scrape_all(cluster)
    assert _moved(before, after, "router", "pdserve_router_requests_total", outcome="invalid") == 1
    for pod in ("prefill-0", "decode-0"):
        assert _moved(before, after, pod, "pdserve_requests_total", outcome="invalid") == 1
        assert _moved(before, after, pod, "pdserve_requests_total", outcome="ok") == 0


def test_an_expired_lease_is_counted_and_its_blocks_come_back(cluster):
    before = _scrape_all(cluster)
    prompt = _prompt(random.Random(3), 50)  # 4 blocks held, never pulled
    answer = _prefill(cluster, "lease-1", prompt, max_tokens=8, ignore_eos=True)
    assert len(answer.handle.block_ids) == 4
    held = _wait_for(cluster, lambda s: s["prefill-0"].get("pdserve_kv_blocks_held_for_peer") == 4, timeout_s=LEASE_S)
    assert held["prefill-0"].get("pdserve_kv_blocks_held_for_peer") == 4
    assert held["prefill-0"].get("pdserve_kv_blocks_used") >= 4
    after = _wait_for(
        cluster, lambda s: _moved(before, s, "prefill-0", "pdserve_lease_expiries_total") >= 1
        and s["prefill-0"].get("pdserve_kv_blocks_held_for_peer") == 0,
        timeout_s=LEASE_S + 5,
    )
    assert _moved(before, after, "prefill-0", "pdserve_lease_expiries_total") == 1
    assert _moved(before, after, "prefill-0", "pdserve_requests_total", outcome="ok") == 1
    _assert_idle(cluster, _wait_for(cluster, lambda s: _is_idle(cluster, s)))


def _total_blocks(cluster: LocalCluster, pod: str) -> int:
    stub_type = prefill_pb2_grpc.PrefillServiceStub if pod.startswith("prefill") else decode_pb2_grpc.DecodeServiceStub
    with grpc.insecure_channel(cluster.by_name(pod).address) as channel:
        return stub_type(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5).load.num_total_blocks


def _is_idle(cluster: LocalCluster, scrapes: dict[str, Scrape]) -> bool:
    try:
        _assert_idle(cluster, scrapes)
    except AssertionError:
        return False
    return True


def _assert_idle(cluster: LocalCluster, scrapes: dict[str, Scrape]) -> None:
    """No request queued or running, and every KV block free again on both pods."""
    for pod in ("prefill-0", "decode-0"):
        scrape = scrapes[pod]
        assert scrape.get("pdserve_kv_blocks_free") == _total_blocks(cluster, pod), pod
        assert scrape.get("pdserve_kv_blocks_used") == 0, pod
        assert scrape.get("pdserve_kv_blocks_held_for_peer") == 0, pod
        assert scrape.get("pdserve_queue_depth") == 0, pod
        assert scrape.get("pdserve_running_requests") == 0, pod
