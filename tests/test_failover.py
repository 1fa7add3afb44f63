"""A decode pod killed mid-stream: the router re-issues the request to the other decode pod and the
client's stream continues without a duplicated or dropped token (three+ OS processes on 127.0.0.1)."""
from __future__ import annotations

import random
import signal

import pytest

from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams

pytestmark = pytest.mark.e2e

MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--num-blocks", "512"]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Round robin so that consecutive requests land on different decode pods.
    with LocalCluster.start(
        pod_args=MODEL_ARGS, num_decode=2, router_args=["--policy", "round-robin"],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as running:
        yield running


def test_decode_pod_killed_mid_stream_is_replaced_without_losing_a_token(cluster):
    prompt = [random.Random(21).randrange(3, 4096) for _ in range(40)]
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = LLMEngine("tiny", SchedulerConfig(max_model_len=2048), CacheConfig(num_blocks=512))
    expected = reference.generate([prompt], SamplingParams(**params))[0].token_ids

    decode_pods = [cluster.by_name("decode-0"), cluster.by_name("decode-1")]
    tokens = []
    killed = None
    with PdserveClient(cluster.router.address) as client:
        for chunk in client.generate(prompt, timeout=120, **params):
            tokens.extend(chunk.token_ids)
            if killed is None and len(tokens) >= 20:
                # Kill whichever decode pod is serving the stream: the one with the request running.
                killed = _serving_decode_pod(decode_pods)
                killed.process.send_signal(signal.SIGKILL)
                killed.process.wait(10)
    assert killed is not None
    assert tokens == expected


def _serving_decode_pod(decode_pods):
    import grpc

    from proto.pdserve.v1 import common_pb2, decode_pb2_grpc

    for pod in decode_pods:
        with grpc.insecure_channel(pod.address) as channel:
            load = decode_pb2_grpc.DecodeServiceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5).load
        if load.num_running or load.num_waiting:
            return pod
    pytest.fail("no decode pod is running the request")
