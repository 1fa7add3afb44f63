"""Per-pod capacity learnt online from what the pods report, with no offline profile: prefill tokens/s
a pod sustains at the TTFT target, decode tokens/s at the ITL target. Each estimate explains itself."""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.sample import TierSample

# p90 of an exponential wait is ln(10) = 2.3 times its mean; half of that for a deterministic-ish
# service (M/D/1's mean wait is half M/M/1's): the p90 wait ~ 1.15 * rho / (1 - rho) * service time.
P90_WAIT_FACTOR = 1.15
MIN_UTILISATION = 0.05
MAX_UTILISATION = 0.9
# A latency over target shrinks the estimate by this factor per interval; one well under it lets it recover.
SHRINK, RECOVER = 0.85, 1.15
MIN_CORRECTION = 0.25
RIDGE = 1e-3  # the prior's pull, relative to the data's own weight


@dataclass(frozen=True)
class Capacity:
    tokens_per_s: float  # one pod's, at the latency target
    reason: str


def decayed(old: float, new: float, weight: float, keep: float) -> float:
    return keep * old + weight * new


class LatencyCorrection:
    """A multiplier in [MIN_CORRECTION, 1] on a model's capacity: what the model misses (routing skew,
    bursts, overheads) shows as a latency over target, and the multiplier closes that gap online."""

    def __init__(self) -> None:
        self.factor = 1.0

    def update(self, latency_p90_s: float | None, target_s: float, is_busy: bool) -> None:
        if latency_p90_s is None:
            return
        if latency_p90_s > target_s and is_busy:
            self.factor = max(MIN_CORRECTION, self.factor * SHRINK)
        elif latency_p90_s < 0.7 * target_s:
            self.factor = min(1.0, self.factor * RECOVER)


class PrefillCapacity:
    """Prompt tokens per busy engine second (decayed average), derated to the utilisation at which a
    queue of prompts of the observed mean length keeps TTFT p90 within the target."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.busy_s = 0.0
        self.num_tokens = 0.0
        self.correction = LatencyCorrection()

    def update(self, tier: TierSample, interval_s: float, ttft_p90_s: float | None, target_s: float) -> None:
        keep = math.exp(-interval_s / self.window_s)
        self.busy_s = decayed(self.busy_s, tier.busy_s, 1.0, keep)
        self.num_tokens = decayed(self.num_tokens, tier.num_tokens, 1.0, keep)
        is_busy = tier.num_pods > 0 and tier.busy_s / (tier.num_pods * interval_s) > 0.5
        self.correction.update(ttft_p90_s, target_s, is_busy or tier.num_waiting > tier.num_pods)

    @property
    def tokens_per_busy_s(self) -> float | None:
        return self.num_tokens / self.busy_s if self.busy_s > 1e-6 and self.num_tokens > 0 else None

    def at_target(self, mean_prompt_tokens: float, target_s: float) -> Capacity | None:
        rate = self.tokens_per_busy_s
        if rate is None or mean_prompt_tokens <= 0:
            return None
        service_s = mean_prompt_tokens / rate
        slack = target_s / service_s - 1.0
        utilisation = MIN_UTILISATION if slack <= 0 else slack / (P90_WAIT_FACTOR + slack)
        utilisation = min(MAX_UTILISATION, max(MIN_UTILISATION, utilisation)) * self.correction.factor
        return Capacity(rate * utilisation, (
            f"{rate:.0f} prompt tok/s busy, {mean_prompt_tokens:.0f}-token prompts take {service_s * 1000:.0f} ms: "
            f"utilisation {utilisation:.2f} keeps TTFT p90 <= {target_s:.2f} s"
            + (f" (latency correction {self.correction.factor:.2f})" if self.correction.factor < 1 else "")
        ))


class StepTimeModel:
    """Decode step time = a + c * batch + d * batch * context_blocks, fitted by least squares over
    intervals with exponential forgetting (ridge-anchored to the first observation until data spreads)."""

    NUM_TERMS = 3

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.gram = [[0.0] * self.NUM_TERMS for _ in range(self.NUM_TERMS)]
        self.moment = [0.0] * self.NUM_TERMS
        self.prior: list[float] | None = None
        self.coefficients: list[float] | None = None

    def update(self, batch: float, context_blocks: float, step_s: float, weight: float, interval_s: float) -> None:
        keep = math.exp(-interval_s / self.window_s)
        terms = (1.0, batch, batch * context_blocks)
        for i in range(self.NUM_TERMS):
            self.moment[i] = keep * self.moment[i] + weight * terms[i] * step_s
            for j in range(self.NUM_TERMS):
                self.gram[i][j] = keep * self.gram[i][j] + weight * terms[i] * terms[j]
        if self.prior is None:
            # Half the first step is fixed cost, half grows with the batch: a guess the data soon overrides.
            self.prior = [step_s / 2, step_s / 2 / max(batch, 1.0), 0.0]
        self.coefficients = self._solve()

    def _solve(self) -> list[float]:
        """Ridge toward the prior, each term's penalty scaled by its own data weight (scale-free):
        (G + l S) theta = m + l S prior; a term that comes out negative (no physical meaning) is fixed
        at 0 and the rest refitted."""
        active = list(range(self.NUM_TERMS))
        while True:
            strengths = {i: RIDGE * max(self.gram[i][i], 1e-12) for i in active}
            matrix = [[self.gram[i][j] + (strengths[i] if i == j else 0.0) for j in active] for i in active]
            vector = [self.moment[i] + strengths[i] * self.prior[i] for i in active]
            solution = dict(zip(active, _solve_linear(matrix, vector)))
            negative = [i for i in active if solution[i] < 0]
            if not negative:
                return [solution.get(i, 0.0) for i in range(self.NUM_TERMS)]
            active.remove(min(negative, key=lambda i: solution[i]))
            if not active:
                return [0.0] * self.NUM_TERMS

    def step_s(self, batch: float, context_blocks: float) -> float | None:
        if self.coefficients is None:
            return None
        a, c, d = self.coefficients
        return a + c * batch + d * batch * context_blocks


def _solve_linear(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (3 x 3: not worth a numpy import in the fast path)."""
    size = len(vector)
    rows = [list(matrix[i]) + [vector[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if abs(rows[col][col]) < 1e-18:
            continue
        for r in range(size):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col])]
    return [rows[i][size] / rows[i][i] if abs(rows[i][i]) >= 1e-18 else 0.0 for i in range(size)]


class DecodeCapacity:
    """Output tokens/s one decode pod gives at the ITL target: the batch whose fitted step time fills
    the target (at the observed context per request), capped by what its KV pool holds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.model = StepTimeModel(window_s)
        self.context_blocks: float | None = None  # KV blocks per running request (decayed mean)
        self.blocks_per_pod: float | None = None
        self.correction = LatencyCorrection()

    def update(self, tier: TierSample, interval_s: float, target_s: float) -> None:
        if tier.num_running > 0 and tier.kv_blocks_used > 0:
            context = tier.kv_blocks_used / tier.num_running
            keep = math.exp(-interval_s / self.window_s)
            self.context_blocks = context if self.context_blocks is None else keep * self.context_blocks + (1 - keep) * context
        if tier.num_pods and tier.kv_blocks_total:
            self.blocks_per_pod = tier.kv_blocks_total / tier.num_pods
        batch, step_s = tier.mean_batch, tier.mean_step_s
        if batch is not None and step_s is not None:
            # Pods idle at the scrape show no context yet: the batch term learns first, the context one later.
            self.model.update(batch, self.context_blocks or 0.0, step_s, float(tier.num_steps), interval_s)
        is_busy = tier.num_pods > 0 and tier.busy_s / (tier.num_pods * interval_s) > 0.5
        self.correction.update(tier.latency_p90_s, target_s, is_busy)

    def batch_at_target(self, step_budget_s: float) -> tuple[float, str] | None:
        """The largest batch within the step budget (and the KV pool), with what limits it."""
        if self.model.coefficients is None:
            return None
        context = self.context_blocks or 0.0
        fixed_s, per_request_s, per_context_s = self.model.coefficients
        slope = per_request_s + per_context_s * context
        batch = (step_budget_s - fixed_s) / slope if slope > 0 else math.inf
        limit = "ITL"
        if self.blocks_per_pod:
            # A request's blocks grow while it decodes: leave room for 1.5x the mean.
            kv_batch = 0.9 * self.blocks_per_pod / (1.5 * max(context, 1.0))
            if kv_batch < batch:
                batch, limit = kv_batch, "KV pool"
        return max(batch, 1.0), limit

    def at_target(self, target_s: float, margin: float) -> Capacity | None:
        found = self.batch_at_target(target_s * margin)
        if found is None:
            return None
        batch, limit = found
        context = self.context_blocks or 0.0
        step_s = self.model.step_s(batch, context) or target_s
        tokens_per_s = batch / max(step_s, 1e-6) * self.correction.factor
        a, c, d = self.model.coefficients
        return Capacity(tokens_per_s, (
            f"step = {a * 1000:.1f} ms + {c * 1000:.2f} ms/request + {d * 1e6:.1f} us/(request*block), "
            f"{context:.0f} blocks/request: batch {batch:.1f} ({limit} bound), step {step_s * 1000:.1f} ms"
            + (f", latency correction {self.correction.factor:.2f}" if self.correction.factor < 1 else "")
        ))
