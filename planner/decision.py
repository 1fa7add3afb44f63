"""The planner's decision, pure: each interval's Sample in, both tiers' desired replica counts out,
each with its reason. The service and the benchmark's simulation drive this same code."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from planner.capacity import Capacity, DecodeCapacity, PrefillCapacity
from planner.forecast import Forecast, HoltForecaster
from planner.policy import ScalingPolicy
from planner.sample import Sample

PREFILL, DECODE = "prefill", "decode"
TIERS = (PREFILL, DECODE)


class Reason(enum.Enum):
    LEARNING = "learning"  # no capacity estimate yet: keep the count
    SCALE_UP = "scale_up"  # the forecast (and backlog) needs more pods
    SCALE_DOWN = "scale_down"  # the need fits fewer pods with the margin to spare
    WITHIN_BAND = "within_band"  # hysteresis: neither up nor (with margin) down
    COOLDOWN = "cooldown"  # would shrink, but the count changed too recently
    AT_MAX = "at_max"  # needs more than the tier's max
    AT_MIN = "at_min"  # needs less than the tier's min
    POD_BUDGET = "pod_budget"  # both tiers together need more than max_pods: shared by need


@dataclass(frozen=True)
class TierDecision:
    tier: str
    current: int
    desired: int
    need: float | None  # pods the forecast and backlog call for (fractional); None while learning
    reason: Reason
    forecast: Forecast
    capacity: Capacity | None

    def explain(self) -> str:
        unit = "prompt tok/s" if self.tier == PREFILL else "output tok/s"
        need = "?" if self.need is None else f"{self.need:.2f}"
        capacity = "unknown" if self.capacity is None else f"{self.capacity.tokens_per_s:.0f} {unit}/pod ({self.capacity.reason})"
        return (f"{self.tier} {self.current} -> {self.desired} ({self.reason.value}): demand "
                f"{self.forecast.explain(unit)}; capacity {capacity}; need {need} pods")


@dataclass(frozen=True)
class Decision:
    at_s: float
    prefill: TierDecision
    decode: TierDecision

    def tier(self, name: str) -> TierDecision:
        return self.prefill if name == PREFILL else self.decode


class Planner:
    """Keeps the estimators' state between intervals; `observe` is the whole decision."""

    def __init__(self, policy: ScalingPolicy, *, num_prefill: int, num_decode: int) -> None:
        self.policy = policy
        self.current = {PREFILL: _clip(num_prefill, policy, PREFILL), DECODE: _clip(num_decode, policy, DECODE)}
        self.changed_at_s: dict[str, float | None] = {PREFILL: None, DECODE: None}
        self.prefill_capacity = PrefillCapacity(policy.capacity_window_s)
        self.decode_capacity = DecodeCapacity(policy.capacity_window_s)
        self.forecasters = {tier: HoltForecaster(policy.forecast_window_s, policy.horizon_s) for tier in TIERS}
        self.mean_prompt_tokens: float | None = None
        self.mean_output_tokens: float | None = None

    def observe(self, sample: Sample, now_s: float) -> Decision:
        policy = self.policy
        self._learn_request_shape(sample)
        self.prefill_capacity.update(sample.prefill, sample.interval_s, sample.ttft_p90_s, policy.ttft_target_s)
        self.decode_capacity.update(sample.decode, sample.interval_s, policy.itl_target_s)
        demand = self._demand(sample)
        forecasts = {tier: self.forecasters[tier].update(rate, sample.interval_s) for tier, rate in demand.items()}
        capacities = {
            PREFILL: self.prefill_capacity.at_target(self.mean_prompt_tokens or 0.0, policy.ttft_target_s),
            DECODE: self.decode_capacity.at_target(policy.itl_target_s, policy.itl_margin),
        }
        # Up on what arrives now or is forecast, whichever is more; down on the smoothed forecast only.
        needs = {tier: self._need(tier, sample, max(forecasts[tier].value, demand[tier]), capacities[tier])
                 for tier in TIERS}
        calm = {tier: self._need(tier, sample, forecasts[tier].value, capacities[tier]) for tier in TIERS}
        choices = {tier: self._choose(tier, needs[tier], calm[tier], now_s) for tier in TIERS}
        choices = self._fit_budget(choices, needs)
        decisions = {}
        for tier in TIERS:
            desired, reason = choices[tier]
            decisions[tier] = TierDecision(tier, self.current[tier], desired, needs[tier], reason,
                                           forecasts[tier], capacities[tier])
            if desired != self.current[tier]:
                self.changed_at_s[tier] = now_s
                self.current[tier] = desired
        return Decision(now_s, decisions[PREFILL], decisions[DECODE])

    def _learn_request_shape(self, sample: Sample) -> None:
        keep = math.exp(-sample.interval_s / self.policy.forecast_window_s)
        if sample.num_arrivals:
            prompt = sample.num_prompt_tokens / sample.num_arrivals
            self.mean_prompt_tokens = _smooth(self.mean_prompt_tokens, prompt, keep)
        if sample.num_finished:
            output = sample.num_output_tokens / sample.num_finished
            self.mean_output_tokens = _smooth(self.mean_output_tokens, output, keep)

    def _demand(self, sample: Sample) -> dict[str, float]:
        """Tokens/s each tier is asked for: prompt tokens arriving; arrivals times the mean output
        (or what decode pods already produce, when more: long outputs show there before they end)."""
        interval = sample.interval_s
        offered = sample.num_arrivals / interval * (self.mean_output_tokens or 0.0)
        return {PREFILL: sample.num_prompt_tokens / interval, DECODE: max(offered, sample.decode.num_tokens / interval)}

    def _need(self, tier: str, sample: Sample, rate: float, capacity: Capacity | None) -> float | None:
        if capacity is None or capacity.tokens_per_s <= 0:
            return None
        if tier == PREFILL:
            # Prompts already queued must drain within one horizon, on top of the demand.
            prompt = max(self.mean_prompt_tokens or 0.0, sample.num_prompt_tokens / max(sample.num_arrivals, 1))
            backlog = sample.prefill.num_waiting * prompt / max(self.policy.horizon_s, 1.0)
            return (rate + backlog) / capacity.tokens_per_s
        found = self.decode_capacity.batch_at_target(self.policy.itl_target_s * self.policy.itl_margin)
        batch = found[0] if found else 1.0
        return rate / capacity.tokens_per_s + sample.decode.num_waiting / batch

    def _choose(self, tier: str, need: float | None, calm_need: float | None, now_s: float) -> tuple[int, Reason]:
        current = self.current[tier]
        if need is None or calm_need is None:
            return current, Reason.LEARNING
        up = math.ceil(need - 1e-9)
        down = math.ceil(max(need, calm_need) / (1.0 - self.policy.scale_down_margin) - 1e-9)
        if up > current:
            desired, reason = up, Reason.SCALE_UP
        elif down < current:
            changed = self.changed_at_s[tier]
            if changed is not None and now_s - changed < self.policy.cooldown_s:
                return current, Reason.COOLDOWN
            # At most halve at once: a capacity estimate learnt under another workload may be off.
            desired, reason = max(down, math.ceil(current / 2)), Reason.SCALE_DOWN
        else:
            return current, Reason.WITHIN_BAND
        clipped = _clip(desired, self.policy, tier)
        if clipped != desired:
            reason = Reason.AT_MAX if clipped < desired else Reason.AT_MIN
        return clipped, reason

    def _fit_budget(self, choices: dict, needs: dict) -> dict:
        """Over max_pods: each tier gets a share of the budget in proportion to its need (at least its min)."""
        budget = self.policy.max_pods
        if budget is None or sum(desired for desired, _ in choices.values()) <= budget:
            return choices
        weights = {tier: needs[tier] if needs[tier] is not None else float(choices[tier][0]) for tier in TIERS}
        total = sum(weights.values()) or 1.0
        prefill = round(budget * weights[PREFILL] / total)
        prefill = min(max(prefill, self.policy.min_prefill, 1), budget - max(self.policy.min_decode, 1))
        prefill = min(prefill, self.policy.max_prefill)
        decode = min(budget - prefill, self.policy.max_decode)
        return {PREFILL: (prefill, Reason.POD_BUDGET), DECODE: (decode, Reason.POD_BUDGET)}


def _clip(count: int, policy: ScalingPolicy, tier: str) -> int:
    return min(max(count, getattr(policy, f"min_{tier}")), getattr(policy, f"max_{tier}"))


def _smooth(old: float | None, new: float, keep: float) -> float:
    return new if old is None else keep * old + (1 - keep) * new
