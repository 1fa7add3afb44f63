"""The planner's own Prometheus metrics: each tier's desired and current count, the need, forecast and
capacity behind it, and every decision counted by its reason."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.decision import TIERS, Decision, Reason


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.desired = Gauge("pdserve_planner_desired_replicas", "Replicas the planner asks for", ["tier"],
                             registry=registry)
        self.previous = Gauge("pdserve_planner_previous_replicas", "Replicas asked for before this decision",
                              ["tier"], registry=registry)
        self.need = Gauge("pdserve_planner_need_pods", "Pods the forecast demand and backlog need (fractional)",
                          ["tier"], registry=registry)
        self.forecast = Gauge("pdserve_planner_forecast_tokens_per_second",
                              "Forecast demand (prefill: prompt tokens/s; decode: output tokens/s)", ["tier"],
                              registry=registry)
        self.capacity = Gauge("pdserve_planner_capacity_tokens_per_second",
                              "One pod's estimated capacity at the latency target", ["tier"], registry=registry)
        self.decisions = Counter("pdserve_planner_decisions", "Decisions by tier and reason", ["tier", "reason"],
                                 registry=registry)
        self.scrape_failures = Counter("pdserve_planner_scrape_failures", "Metrics endpoints that did not answer",
                                       ["source"], registry=registry)
        for tier in TIERS:
            for reason in Reason:
                self.decisions.labels(tier=tier, reason=reason.value)

    def record(self, decision: Decision) -> None:
        for tier in TIERS:
            made = decision.tier(tier)
            self.desired.labels(tier=tier).set(made.desired)
            self.previous.labels(tier=tier).set(made.current)
            self.need.labels(tier=tier).set(made.need if made.need is not None else float("nan"))
            self.forecast.labels(tier=tier).set(made.forecast.value)
            capacity = made.capacity.tokens_per_s if made.capacity is not None else float("nan")
            self.capacity.labels(tier=tier).set(capacity)
            self.decisions.labels(tier=tier, reason=made.reason.value).inc()
