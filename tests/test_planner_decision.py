"""The planner's pure decision (planner/decision.py and its estimators): capacity learnt from what pods
report, the demand forecast, and the replica choice with hysteresis, cooldown, bounds and a pod budget."""
from __future__ import annotations

import dataclasses
import math

import pytest

from planner.capacity import DecodeCapacity, PrefillCapacity, StepTimeModel
from planner.decision import Planner, Reason
from planner.forecast import HoltForecaster
from planner.policy import ScalingPolicy
from planner.sample import Sample, TierSample

# A synthetic decode pod: step = 5 ms + 0.5 ms per request + 2 us per request per block.
FIXED_S, PER_REQUEST_S, PER_CONTEXT_S = 0.005, 0.0005, 2e-6


def decode_tier(num_pods: int, batch: float, blocks: float, interval_s: float = 10.0, **extra) -> TierSample:
    step_s = FIXED_S + PER_REQUEST_S * batch + PER_CONTEXT_S * batch * blocks
    steps = int(interval_s * num_pods / step_s)
    return TierSample(num_pods=num_pods, busy_s=steps * step_s, num_steps=steps, num_tokens=int(steps * batch),
                      num_running=batch * num_pods, kv_blocks_used=batch * blocks * num_pods,
                      kv_blocks_total=10_000 * num_pods, **extra)


def prefill_tier(num_pods: int, tokens_per_s: float, busy_share: float, interval_s: float = 10.0, **extra):
    busy = busy_share * interval_s * num_pods
    return TierSample(num_pods=num_pods, busy_s=busy, num_steps=max(1, int(busy * 4)),
                      num_tokens=int(busy * tokens_per_s), **extra)


def sample(prompt_tokens_per_s: float, arrivals_per_s: float, output_tokens: float, prefill: TierSample,
           decode: TierSample, interval_s: float = 10.0, ttft_p90_s: float | None = 0.5) -> Sample:
    arrivals = int(arrivals_per_s * interval_s)
    return Sample(interval_s=interval_s, num_arrivals=arrivals, num_prompt_tokens=int(prompt_tokens_per_s * interval_s),
                  num_finished=arrivals, num_output_tokens=int(arrivals * output_tokens),
                  prefill=prefill, decode=decode, ttft_p90_s=ttft_p90_s)


def test_step_time_model_recovers_the_pods_coefficients_from_varied_batches():
    model = StepTimeModel(window_s=300.0)
    for batch, blocks in [(4, 20), (16, 20), (32, 60), (8, 100), (24, 40), (12, 80)] * 3:
        step_s = FIXED_S + PER_REQUEST_S * batch + PER_CONTEXT_S * batch * blocks
        model.update(batch, blocks, step_s, weight=100.0, interval_s=10.0)
    fixed, per_request, per_context = model.coefficients
    assert fixed == pytest.approx(FIXED_S, rel=0.05)
    assert per_request == pytest.approx(PER_REQUEST_S, rel=0.05)
    assert per_context == pytest.approx(PER_CONTEXT_S, rel=0.1)


def test_decode_capacity_is_the_batch_that_fills_the_itl_target():
    capacity = DecodeCapacity(window_s=300.0)
    for batch in (4, 16, 32, 8, 24, 12) * 3:
        capacity.update(decode_tier(1, batch, blocks=50), 10.0, target_s=0.05)
    found = capacity.at_target(0.05, margin=1.0)
    # 0.05 = 0.005 + b * (0.0005 + 2e-6 * 50) -> b = 75 requests per step of 50 ms: 1,500 tokens/s.
    assert found.tokens_per_s == pytest.approx(1500, rel=0.05)
    assert "ITL bound" in found.reason


def test_decode_capacity_is_capped_by_the_kv_pool():
    capacity = DecodeCapacity(window_s=300.0)
    for batch in (4, 16, 32, 8):
        capacity.update(dataclasses.replace(decode_tier(1, batch, blocks=500), kv_blocks_total=3000), 10.0, 0.05)
    batch, limit = capacity.batch_at_target(0.05)
    assert limit == "KV pool" and batch == pytest.approx(0.9 * 3000 / 750, rel=0.01)


def test_prefill_capacity_derates_the_pods_speed_to_meet_the_ttft_target():
    capacity = PrefillCapacity(window_s=120.0)
    capacity.update(prefill_tier(2, tokens_per_s=10_000, busy_share=0.5), 10.0, ttft_p90_s=0.3, target_s=1.0)
    assert capacity.tokens_per_busy_s == pytest.approx(10_000, rel=0.01)
    # 2,000-token prompts take 0.2 s: slack 4, utilisation 4 / 5.15.
    assert capacity.at_target(2000, 1.0).tokens_per_s == pytest.approx(10_000 * 4 / 5.15, rel=0.02)
    # A prompt that alone takes longer than the target leaves the minimum utilisation.
    assert capacity.at_target(20_000, 1.0).tokens_per_s == pytest.approx(500, rel=0.02)


def test_prefill_capacity_shrinks_while_ttft_is_over_target_and_recovers():
    capacity = PrefillCapacity(window_s=120.0)
    busy = prefill_tier(1, tokens_per_s=10_000, busy_share=0.9, num_waiting=3)
    for _ in range(3):
        capacity.update(busy, 10.0, ttft_p90_s=2.0, target_s=1.0)
    assert capacity.correction.factor == pytest.approx(0.85 ** 3)
    for _ in range(20):
        capacity.update(busy, 10.0, ttft_p90_s=0.2, target_s=1.0)
    assert capacity.correction.factor == 1.0


def test_forecast_follows_a_ramp_ahead_and_never_projects_a_fall_below_now():
    forecaster = HoltForecaster(window_s=30.0, horizon_s=30.0)
    for step in range(30):
        rising = forecaster.update(100.0 + 10.0 * step, 10.0)
    assert rising.trend_per_s > 0 and rising.value > rising.level
    for _ in range(3):
        falling = forecaster.update(50.0, 10.0)
    assert falling.trend_per_s < 0 and falling.value == falling.level
    assert "trend" in falling.explain("tok/s")


POLICY = ScalingPolicy(ttft_target_s=1.0, itl_target_s=0.05, max_prefill=6, max_decode=6, interval_s=10.0,
                       cooldown_s=60.0, itl_margin=1.0, forecast_window_s=10.0)


def steady(planner: Planner, prompt_tokens_per_s: float, arrivals_per_s: float, output_tokens: float,
           num_intervals: int, start_s: float = 0.0, batch: float = 20.0):
    decision = None
    for index in range(num_intervals):
        num_prefill, num_decode = planner.current["prefill"], planner.current["decode"]
        decision = planner.observe(sample(
            prompt_tokens_per_s, arrivals_per_s, output_tokens,
            prefill_tier(num_prefill, tokens_per_s=10_000, busy_share=0.5),
            decode_tier(num_decode, batch=batch + (index % 3) * 8, blocks=50),
        ), start_s + 10.0 * index)
    return decision


def test_planner_learns_then_sizes_both_tiers_to_the_demand():
    planner = Planner(POLICY, num_prefill=1, num_decode=1)
    decision = steady(planner, prompt_tokens_per_s=20_000, arrivals_per_s=10, output_tokens=300, num_intervals=8)
    # Prefill: 2,000-token prompts, 7,767 tok/s per pod at the target -> 3 pods. Decode: 3,000 tok/s at
    # 1,500 per pod -> 2 pods (the fitted model is learnt from the pods' own reports).
    assert (decision.prefill.desired, decision.decode.desired) == (3, 2)
    assert decision.prefill.need == pytest.approx(20_000 / (10_000 * 4 / 5.15), rel=0.05)
    assert "prefill" in decision.prefill.explain() and "need" in decision.decode.explain()


def test_planner_holds_within_the_band_and_waits_out_the_cooldown_before_shrinking():
    planner = Planner(POLICY, num_prefill=1, num_decode=1)
    steady(planner, 20_000, 10, 300, num_intervals=8)
    assert planner.current["prefill"] == 3
    # Demand falls to 2.2 pods' worth: 3 pods hold (2.2 / 0.8 = 2.75 rounds up to 3).
    held = steady(planner, 17_100, 10, 300, num_intervals=1, start_s=100.0)
    assert held.prefill.reason is Reason.WITHIN_BAND and held.prefill.desired == 3
    # Demand halves: it would shrink, but the count changed under 60 s ago.
    planner.changed_at_s["prefill"] = 95.0
    cooling = steady(planner, 5_000, 10, 300, num_intervals=1, start_s=110.0)
    assert cooling.prefill.reason is Reason.COOLDOWN and cooling.prefill.desired == 3
    shrunk = steady(planner, 5_000, 10, 300, num_intervals=6, start_s=160.0)
    assert shrunk.prefill.desired < 3
    assert planner.changed_at_s["prefill"] >= 160.0


def test_planner_never_leaves_the_bounds_nor_the_pod_budget():
    planner = Planner(POLICY, num_prefill=1, num_decode=1)
    decision = steady(planner, 200_000, 10, 300, num_intervals=5)
    assert decision.prefill.desired == 6 and decision.prefill.reason is Reason.AT_MAX
    budget = dataclasses.replace(POLICY, max_pods=4)
    planner = Planner(budget, num_prefill=1, num_decode=1)
    decision = steady(planner, 40_000, 20, 400, num_intervals=8)
    assert decision.prefill.desired + decision.decode.desired == 4
    assert decision.prefill.reason is Reason.POD_BUDGET and min(decision.prefill.desired, decision.decode.desired) >= 1


def test_planner_keeps_the_count_while_it_has_no_capacity_estimate():
    planner = Planner(POLICY, num_prefill=2, num_decode=3)
    idle = Sample(interval_s=10.0, num_arrivals=0, num_prompt_tokens=0, num_finished=0, num_output_tokens=0,
                  prefill=TierSample(num_pods=2), decode=TierSample(num_pods=3))
    decision = planner.observe(idle, 0.0)
    assert (decision.prefill.desired, decision.decode.desired) == (2, 3)
    assert decision.prefill.reason is Reason.LEARNING and decision.decode.reason is Reason.LEARNING


def test_policy_refuses_inconsistent_bounds_by_name():
    with pytest.raises(ValueError, match="min_decode"):
        ScalingPolicy(min_decode=5, max_decode=2)
    with pytest.raises(ValueError, match="max_pods"):
        ScalingPolicy(max_pods=1)
    with pytest.raises(ValueError, match="itl_target_s"):
        ScalingPolicy(itl_target_s=0)


def test_a_sudden_rise_is_covered_in_the_next_decision():
    planner = Planner(POLICY, num_prefill=1, num_decode=1)
    steady(planner, 5_000, 10, 300, num_intervals=8)
    assert planner.current["prefill"] == 1
    # Prompt tokens jump fourfold: one interval later the count covers at least the new rate (the smoothed
    # level alone is still far below it).
    jumped = steady(planner, 20_000, 10, 300, num_intervals=1, start_s=100.0)
    assert jumped.prefill.reason is Reason.SCALE_UP
    assert jumped.prefill.need >= 20_000 / jumped.prefill.capacity.tokens_per_s
    assert jumped.prefill.desired == math.ceil(jumped.prefill.need) >= 3
    assert jumped.prefill.forecast.level < 20_000
