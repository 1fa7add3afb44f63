"""Prometheus text -> the cumulative readings the planner uses, and two readings -> one interval's
Sample (counter deltas, histogram p90 over the interval). Pure: the fetching is in scrape.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from planner.sample import Sample, TierSample

# The names the pods and the router export (shared/serving/server/metrics.py, router/metrics.py).
POD_COUNTERS = {"pdserve_engine_busy_seconds": "busy_s", "pdserve_engine_steps": "num_steps",
                "pdserve_engine_tokens": "num_tokens"}
POD_GAUGES = {"pdserve_queue_depth": "num_waiting", "pdserve_running_requests": "num_running",
              "pdserve_kv_blocks_used": "kv_blocks_used", "pdserve_kv_blocks_free": "kv_blocks_free"}
POD_LATENCY = {"prefill": "pdserve_ttft_seconds", "decode": "pdserve_tpot_seconds"}
ROUTER_PROMPTS = "pdserve_router_prompt_tokens"  # histogram: _count arrivals, _sum prompt tokens
ROUTER_OUTPUTS = "pdserve_router_output_tokens"  # histogram: _count finished, _sum output tokens
ROUTER_TTFT = "pdserve_router_ttft_seconds"


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), +Inf last
    count: float = 0.0
    total: float = 0.0

    def minus(self, older: "Histogram | None") -> "Histogram":
        if older is None or older.count > self.count:  # first reading, or the process restarted
            return self
        old = dict(older.buckets)
        return Histogram(tuple((bound, count - old.get(bound, 0.0)) for bound, count in self.buckets),
                         self.count - older.count, self.total - older.total)

    def quantile(self, q: float) -> float | None:
        """As PromQL's histogram_quantile: linear within the bucket the rank falls in."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in self.buckets:
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                width = count - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclass(frozen=True)
class Reading:
    """One target's cumulative values at one scrape."""

    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def counter_delta(self, name: str, older: "Reading | None") -> float:
        now = self.values.get(name, 0.0)
        before = older.values.get(name, 0.0) if older is not None else 0.0
        return now if now < before else now - before

    def histogram_delta(self, name: str, older: "Reading | None") -> Histogram:
        return self.histograms.get(name, Histogram()).minus(older.histograms.get(name) if older else None)


def parse_reading(text: str) -> Reading:
    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    histograms: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "histogram":
                if sample.name.endswith("_bucket"):
                    buckets.setdefault(family.name, []).append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_count"):
                    values[f"{family.name}_count"] = sample.value
                elif sample.name.endswith("_sum"):
                    values[f"{family.name}_sum"] = sample.value
            elif family.type in ("counter", "gauge") and not sample.labels and not sample.name.endswith("_created"):
                values[family.name] = sample.value
    for name, rows in buckets.items():
        histograms[name] = Histogram(tuple(sorted(rows)), values.get(f"{name}_count", 0.0), values.get(f"{name}_sum", 0.0))
    return Reading(values, histograms)


def tier_sample(tier: str, now: dict[str, Reading], before: dict[str, Reading]) -> TierSample:
    """One tier's pods, summed: counters as deltas since `before`, gauges as of now, latency p90 pooled."""
    totals = dict.fromkeys([*POD_COUNTERS.values(), *POD_GAUGES.values()], 0.0)
    pooled: Histogram | None = None
    for address, reading in now.items():
        older = before.get(address)
        for name, key in POD_COUNTERS.items():
            totals[key] += reading.counter_delta(name, older)
        for name, key in POD_GAUGES.items():
            totals[key] += reading.values.get(name, 0.0)
        pooled = _pool(pooled, reading.histogram_delta(POD_LATENCY[tier], older))
    return TierSample(
        num_pods=len(now), busy_s=totals["busy_s"], num_steps=int(totals["num_steps"]),
        num_tokens=int(totals["num_tokens"]), num_waiting=totals["num_waiting"], num_running=totals["num_running"],
        kv_blocks_used=totals["kv_blocks_used"], kv_blocks_total=totals["kv_blocks_used"] + totals["kv_blocks_free"],
        latency_p90_s=pooled.quantile(0.9) if pooled is not None else None,
    )


def build_sample(interval_s: float, router: tuple[dict, dict], prefill: tuple[dict, dict],
                 decode: tuple[dict, dict]) -> Sample:
    """Readings (by address) now and at the previous decision -> the interval's Sample; the router
    replicas' demand is added up."""
    now, before = router
    prompts = outputs = ttft = None
    for address, reading in now.items():
        older = before.get(address)
        prompts = _pool(prompts, reading.histogram_delta(ROUTER_PROMPTS, older))
        outputs = _pool(outputs, reading.histogram_delta(ROUTER_OUTPUTS, older))
        ttft = _pool(ttft, reading.histogram_delta(ROUTER_TTFT, older))
    prompts, outputs, ttft = (h or Histogram() for h in (prompts, outputs, ttft))
    return Sample(
        interval_s=interval_s, num_arrivals=int(prompts.count), num_prompt_tokens=int(prompts.total),
        num_finished=int(outputs.count), num_output_tokens=int(outputs.total),
        prefill=tier_sample("prefill", *prefill), decode=tier_sample("decode", *decode),
        ttft_p90_s=ttft.quantile(0.9),
    )


def _pool(total: Histogram | None, part: Histogram) -> Histogram:
    if total is None or not total.buckets:
        return part
    if not part.buckets:
        return total
    counts = dict(part.buckets)
    return Histogram(tuple((bound, count + counts.get(bound, 0.0)) for bound, count in total.buckets),
                     total.count + part.count, total.total + part.total)
