"""KV-aware routing across 2 prefill + 2 decode pods (OS processes on 127.0.0.1): the router sends a
request to the prefill pod that holds its prefix and to the decode pod that saves the most pull bytes,
and a follow-up whose uncached suffix is short goes straight to a decode pod, with the same output as
the single-process engine."""
from __future__ import annotations

import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.wire.common import sampling_params_to_proto
from shared.serving.wire.prefill import prefill_request_to_proto

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 16
LOCAL_PREFILL_BELOW = 48
MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", "512"]
# tiny: 4 layers, 4 KV heads of 32 dims, float32 -> K and V of one block, all layers.
BYTES_PER_BLOCK = 4 * 2 * BLOCK_SIZE * 4 * 32 * 4
# Events reach the router within a flush interval (10 ms); this leaves room for a loaded machine.
EVENT_SETTLE_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster.start(
        pod_args=MODEL_ARGS,
        prefill_args=["--lease-s", "5"],
        router_args=["--policy", "kv-aware", "--local-prefill-below", str(LOCAL_PREFILL_BELOW)],
        num_prefill=2,
        num_decode=2,
        with_metrics=True,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as running:
        time.sleep(EVENT_SETTLE_S)  # the router opens its event streams after its first poll
        yield running


@pytest.fixture(scope="module")
def reference():
    return LLMEngine("tiny", SchedulerConfig(max_model_len=2048), CacheConfig(block_size=BLOCK_SIZE, num_blocks=512))


def _tokens(num: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(num)]


def _generate(cluster: LocalCluster, prompt: list[int], **sampling) -> list[int]:
    tokens: list[int] = []
    with PdserveClient(cluster.router.address) as client:
        for chunk in client.generate(prompt, timeout=60, **sampling):
            tokens.extend(chunk.token_ids)
    return tokens


def _metric(url: str, sample_name: str, **labels) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _ok_requests(cluster: LocalCluster) -> dict[str, float]:
    names = ("prefill-0", "prefill-1", "decode-0", "decode-1")
    return {n: _metric(cluster.by_name(n).metrics_url, "pdserve_requests_total", outcome="ok") for n in names}


def _unpicked_by_address(cluster: LocalCluster, tier: str) -> str:
    """The pod that load alone would not pick when both are idle (ties go to the lower address)."""
    return max((f"{tier}-0", f"{tier}-1"), key=lambda name: cluster.by_name(name).address)


def test_prefill_goes_to_the_pod_holding_the_prefix(cluster):
    holder = _unpicked_by_address(cluster, "prefill")
    prefix = _tokens(160, seed=1)
    with grpc.insecure_channel(cluster.by_name(holder).address) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        answer = stub.Prefill(prefill_request_to_proto("warm-prefill", prefix, SamplingParams(max_tokens=4)),
                              timeout=30)
        stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(request_id="warm-prefill", engine_id=answer.handle.engine_id),
                       timeout=10)
    time.sleep(EVENT_SETTLE_S)
    before = _ok_requests(cluster)
    _generate(cluster, prefix + _tokens(80, seed=2), max_tokens=4, ignore_eos=True)
    after = _ok_requests(cluster)
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    assert after[holder] == before[holder] + 1
    assert after[other] == before[other]


def test_decode_goes_to_the_pod_that_saves_pull_bytes(cluster):
    holder = _unpicked_by_address(cluster, "decode")
    prefix = _tokens(160, seed=3)  # 10 full blocks
    warm = decode_pb2.DecodeRequest(
        request_id="warm-decode", prompt_token_ids=prefix,
        sampling=sampling_params_to_proto(SamplingParams(max_tokens=2, ignore_eos=True)),
    )
    with grpc.insecure_channel(cluster.by_name(holder).address) as channel:
        list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(warm, timeout=30))
    time.sleep(EVENT_SETTLE_S)
    url = cluster.by_name(holder).metrics_url
    bytes_before = _metric(url, "pdserve_kv_transfer_bytes_total")
    before = _ok_requests(cluster)
    _generate(cluster, prefix + _tokens(80, seed=4), max_tokens=4, ignore_eos=True)  # 15 blocks
    after = _ok_requests(cluster)
    other = "decode-1" if holder == "decode-0" else "decode-0"
    assert after[holder] == before[holder] + 1 and after[other] == before[other]
    pulled = _metric(url, "pdserve_kv_transfer_bytes_total") - bytes_before
    assert 0 < pulled <= 5 * BYTES_PER_BLOCK  # the 10 cached blocks were not pulled


@pytest.mark.parametrize("sampling", [
    dict(max_tokens=8, ignore_eos=True),
    dict(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=50, seed=21),
], ids=["greedy", "seeded"])
def test_short_suffix_skips_prefill_with_unchanged_output(cluster, reference, sampling):
    router_url = cluster.router.metrics_url
    first_prompt = _tokens(100, seed=5 + len(sampling))
    skipped_before = _metric(router_url, "pdserve_router_route_decisions_total",
                             route="decode_only", reason="short_uncached_suffix")
    first = _generate(cluster, first_prompt, **sampling)
    assert first == reference.generate([first_prompt], SamplingParams(**sampling))[0].token_ids
    assert _metric(router_url, "pdserve_router_route_decisions_total", route="decode_only",
                   reason="short_uncached_suffix") == skipped_before  # 100 uncached tokens: split
    time.sleep(EVENT_SETTLE_S)

    # The next turn: the decode pod holds the first turn's blocks (prompt and output), 20 tokens are new.
    follow_up = first_prompt + first + _tokens(20, seed=6)
    prefill_before = sum(v for k, v in _ok_requests(cluster).items() if k.startswith("prefill"))
    second = _generate(cluster, follow_up, **sampling)
    assert _metric(router_url, "pdserve_router_route_decisions_total", route="decode_only",
                   reason="short_uncached_suffix") == skipped_before + 1
    assert sum(v for k, v in _ok_requests(cluster).items() if k.startswith("prefill")) == prefill_before
    assert second == reference.generate([follow_up], SamplingParams(**sampling))[0].token_ids
