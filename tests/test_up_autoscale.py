"""`pdserve up --autoscale`'s local pods, as real processes behind a real router: a decode pod scaled down while
requests stream through it leaves the router's rotation, finishes them and exits (none lost); a pod scaled up
joins the rotation and serves; the command itself starts a system the router finds through its worker lists."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import AsyncPdserveClient
from pdserve.launcher import LocalCluster, free_port
from pdserve.local_pods import LocalPods, PodState, PodTimings, read_rotation
from pdserve.up_autoscale import AutoscaleConfig, pod_flags, start_router
from planner.policy import ScalingPolicy
from planner.readings import parse_reading

POD_ARGS = ["--model", "tiny", "--dtype", "float32", "--seed", "0", "--max-num-seqs", "8", "--num-blocks", "256"]
VOCAB_SIZE = 4096  # of the tiny preset
NUM_STREAMS, NUM_TOKENS = 8, 600  # long enough to be decoding when the gauge is read (every 0.5 s)


def test_the_start_counts_must_fit_the_policy():
    config = AutoscaleConfig(autoscale=True, policy=ScalingPolicy(max_pods=3, max_decode=2))
    config.check_start(1, 2)
    with pytest.raises(ValueError, match="exceed --max-pods 3"):
        AutoscaleConfig(autoscale=True, policy=ScalingPolicy(max_pods=3)).check_start(2, 2)
    with pytest.raises(ValueError, match="--decode-pods 3 is outside"):
        config.check_start(1, 3)
    with pytest.raises(ValueError, match="needs --max-pods"):
        AutoscaleConfig(autoscale=True)
    assert pod_flags(config, ["--num-threads", "2"], [])[:4] == ["--num-threads", "1", "--grace-seconds", "300.0"]


def _pod_reading(pod):
    with urllib.request.urlopen(pod.service.metrics_url, timeout=5) as response:
        return parse_reading(response.read().decode())


def _router_retries(router) -> float:
    with urllib.request.urlopen(router.metrics_url, timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(s.value for f in families if f.name == "pdserve_router_retries" for s in f.samples
                   if s.name.endswith("_total"))


async def _stream(address: str, seed: int) -> int:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(48)]
    client = AsyncPdserveClient(address)
    try:
        num_tokens = 0
        async for chunk in client.generate(prompt, max_tokens=NUM_TOKENS, ignore_eos=True, timeout=300):
            num_tokens += len(chunk.token_ids)
        return num_tokens
    finally:
        await client.close()


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_scale_down_while_requests_stream_loses_none_and_a_new_pod_joins(tmp_path):
    log_dir = tmp_path / "logs"
    cluster = LocalCluster(with_metrics=True)
    flags = pod_flags(AutoscaleConfig(drain_seconds=120), POD_ARGS, [])

    async def scenario():
        pods = LocalPods(cluster, {"prefill": flags, "decode": flags}, log_dir, PodTimings(drain_s=120))
        try:
            await pods.start_initial({"prefill": 1, "decode": 2})
            router = await start_router(cluster, pods, log_dir=log_dir, port=None, http_port=None,
                                        router_args=["--tokenizer", "tiny", "--policy", "round-robin"])
            leaving = pods.of("decode")[-1]
            streams = [asyncio.ensure_future(_stream(router.address, seed)) for seed in range(NUM_STREAMS)]
            # Scale down only once the pod is decoding some of them (its gauge refreshes every 0.5 s).
            await _until(lambda: _pod_reading(leaving).values.get("pdserve_running_requests", 0) >= 1, 120,
                         "requests running on the pod to drain")
            pods.scale_to("decode", 1)
            assert leaving.state is PodState.DRAINING
            await pods.settled()
            assert await asyncio.gather(*streams) == [NUM_TOKENS] * NUM_STREAMS  # none lost, none cut short
            assert _router_retries(router) == 0  # finished where they ran: none re-issued on another pod
            assert leaving.service.process.returncode == 0 and leaving not in pods.pods
            rotation = read_rotation(router.metrics_url)
            assert leaving.service.address not in {address for _, address in rotation}
            drain_log = leaving.service.log_tail(200_000)
            assert "drain finished" in drain_log and "0 were ended with an error" in drain_log
            assert pods.list_file("decode").read_text().count("127.0.0.1:") == 1

            pods.scale_to("decode", 2)
            await pods.settled()
            joined = pods.of("decode")[-1]
            assert joined.service.name == "decode-2" and joined.state is PodState.SERVING
            assert read_rotation(router.metrics_url)[("decode", joined.service.address)] == 1.0
            assert await asyncio.gather(*(_stream(router.address, seed) for seed in range(4))) == [NUM_TOKENS] * 4
            await _until(lambda: _pod_reading(joined).values.get("pdserve_engine_tokens", 0) > 0, 10,
                         "the new pod to have decoded")  # round-robin: it took its share

            pods.scale_to("decode", 3)  # and at once back: the pod still starting is the one that goes
            pods.scale_to("decode", 2)
            await pods.settled()
            assert [p.service.name for p in pods.of("decode")] == ["decode-0", "decode-2"]
            assert pods.num_failed_starts == 0
            assert pods.list_file("decode").read_text().count("127.0.0.1:") == 2
        finally:
            await pods.close()

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_up_autoscale_serves_through_its_worker_lists(tmp_path):
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--autoscale", "--max-pods", "3",
               "--port", str(free_port()), "--http-port", str(free_port()), "--log-dir", str(tmp_path / "logs"),
               "--pod-args=--max-num-seqs 8 --num-blocks 256", "--demo", "--max-tokens", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prefill-0" in done.stdout and "decode-0" in done.stdout and "serving after" in done.stdout
    answer = done.stdout.splitlines()[done.stdout.splitlines().index("asking 'What is the capital of France?':") + 1]
    assert answer.strip(), done.stdout
    for tier in ("prefill", "decode"):
        assert (tmp_path / "logs" / f"{tier}.pods").read_text().count("127.0.0.1:") == 1
