"""planner/readings.py: the exposition the pods (ServiceMetrics) and the router (RouterMetrics) really
export, parsed into readings, and two readings turned into one interval's Sample."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from planner.readings import Histogram, build_sample, parse_reading
from router.metrics import RouterMetrics
from shared.serving.server.metrics import ServiceMetrics


def read(metrics) -> object:
    return parse_reading(generate_latest(metrics.registry).decode())


def pod(busy_s: float, steps: int, tokens: int, latencies: list[float], waiting: int, running: int) -> ServiceMetrics:
    metrics = ServiceMetrics()
    metrics.engine_busy_seconds.inc(busy_s)
    metrics.engine_steps.inc(steps)
    metrics.engine_tokens.inc(tokens)
    for seconds in latencies:
        metrics.tpot_seconds.observe(seconds)
        metrics.ttft_seconds.observe(seconds * 10)
    metrics.set_queue(num_waiting=waiting, num_running=running)
    metrics.set_kv_blocks(num_used=30, num_free=70, num_held_for_peer=0)
    return metrics


def test_two_readings_make_the_intervals_sample():
    router = RouterMetrics(CollectorRegistry())
    for prompt in (100, 300):
        router.prompt_tokens.observe(prompt)
    router.output_tokens.observe(50)
    before_router = read(router)
    decode_a, decode_b = pod(1.0, 100, 800, [0.01], 0, 8), pod(2.0, 100, 900, [], 1, 9)
    before_decode = {"a": read(decode_a), "b": read(decode_b)}
    for prompt in (1000, 2000, 3000):
        router.prompt_tokens.observe(prompt)
    router.output_tokens.observe(70)
    router.output_tokens.observe(130)
    router.ttft_seconds.observe(0.3)
    decode_a.engine_busy_seconds.inc(4.0)
    decode_a.engine_steps.inc(200)
    decode_a.engine_tokens.inc(3200)
    for seconds in [0.02] * 9 + [0.2]:
        decode_a.tpot_seconds.observe(seconds)
    now_decode = {"a": read(decode_a), "b": read(decode_b)}
    prefill_now = {"p": read(pod(5.0, 10, 5000, [], 2, 1))}
    sample = build_sample(10.0, ({"r": read(router)}, {"r": before_router}), (prefill_now, {}), (now_decode, before_decode))
    assert (sample.num_arrivals, sample.num_prompt_tokens) == (3, 6000)
    assert (sample.num_finished, sample.num_output_tokens) == (2, 200)
    assert sample.decode.num_pods == 2
    assert (sample.decode.busy_s, sample.decode.num_steps, sample.decode.num_tokens) == (4.0, 200, 3200)
    assert (sample.decode.num_waiting, sample.decode.num_running) == (1, 17)
    assert (sample.decode.kv_blocks_used, sample.decode.kv_blocks_total) == (60, 200)
    # 9 of 10 new TPOTs in the (0.01, 0.025] bucket: p90 at its top, as PromQL's histogram_quantile.
    assert sample.decode.latency_p90_s == pytest.approx(0.025)
    # A pod seen for the first time counts from zero.
    assert (sample.prefill.busy_s, sample.prefill.num_tokens) == (5.0, 5000)
    assert sample.ttft_p90_s == pytest.approx(0.25 + 0.25 * 0.9)


def test_a_restarted_process_counts_from_zero_not_backwards():
    before = read(pod(100.0, 1000, 9000, [0.01] * 5, 0, 0))
    after = read(pod(3.0, 30, 300, [0.01], 0, 0))
    assert after.counter_delta("pdserve_engine_busy_seconds", before) == 3.0
    assert after.histogram_delta("pdserve_tpot_seconds", before).count == 1


def test_quantile_of_an_empty_interval_is_none():
    assert Histogram().quantile(0.9) is None
