"""The planner's loop against a real split system (router, prefill and decode pod processes): the
counters it reads move with routed traffic, and the decision it publishes carries capacities learnt
from those pods."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import CollectorRegistry

from pdserve.client import PdserveClient
from planner.decision import Planner
from planner.keda_scaler import DesiredReplicas
from planner.loop import PlanningLoop
from planner.metrics import PlannerMetrics
from planner.policy import ScalingPolicy
from planner.scrape import parse_targets
from split_cluster import VOCAB_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_the_loop_learns_both_tiers_from_real_pods(split_cluster):
    targets = {}
    for source, name in (("router", "router"), ("prefill", "prefill-0"), ("decode", "decode-0")):
        url = split_cluster.by_name(name).metrics_url  # http://HOST:PORT/metrics
        targets[source] = parse_targets([url.removeprefix("http://").removesuffix("/metrics")])
    planner = Planner(ScalingPolicy(ttft_target_s=5.0, itl_target_s=0.5, interval_s=1.0), num_prefill=1, num_decode=1)
    desired = DesiredReplicas(1, 1)
    loop = PlanningLoop(planner, targets, desired, PlannerMetrics(CollectorRegistry()), scrape_timeout_s=5.0)
    rng = random.Random(3)
    lengths = [40, 80, 120, 160]

    async def scenario():
        assert await loop.step() is None  # the baseline scrape
        started = time.monotonic()
        with PdserveClient(split_cluster.router.address) as client:
            for length in lengths:
                prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]
                chunks = list(client.generate(prompt, max_tokens=8, ignore_eos=True, timeout=60))
                assert sum(len(chunk.token_ids) for chunk in chunks) == 8
        await asyncio.sleep(max(0.0, 1.5 - (time.monotonic() - started)))  # the pods refresh every 0.5 s
        return await loop.step()

    decision = asyncio.run(scenario())
    assert decision is not None
    # The router's demand histograms and the pods' engine counters moved with the traffic.
    assert planner.mean_prompt_tokens == pytest.approx(sum(lengths) / len(lengths))
    assert planner.mean_output_tokens == pytest.approx(8)
    assert planner.prefill_capacity.tokens_per_busy_s > 0
    assert decision.prefill.capacity is not None and decision.decode.capacity is not None
    assert decision.decode.capacity.tokens_per_s > 0 and decision.decode.need is not None
    assert desired.counts == {"prefill": decision.prefill.desired, "decode": decision.decode.desired}
