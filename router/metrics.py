"""The router's Prometheus metrics, on a registry the composition root owns (no global registry)."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from shared.serving.server.metrics import TTFT_BUCKETS_S
from shared.serving.pod.outcomes import OUTCOMES

TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter(
            "pdserve_router_requests", "Generate calls by outcome (the pods' labels)",
            ["outcome"], registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.ttft_seconds = Histogram(
            "pdserve_router_ttft_seconds", "Time from the Generate call to token 1 leaving the router",
            buckets=TTFT_BUCKETS_S, registry=registry,
        )
        # The demand the planner (planner/) forecasts: prompt tokens arriving, output tokens per request.
        self.prompt_tokens = Histogram(
            "pdserve_router_prompt_tokens", "Prompt tokens of each request accepted (times n completions)",
            buckets=TOKEN_BUCKETS, registry=registry,
        )
        self.output_tokens = Histogram(
            "pdserve_router_output_tokens", "Output tokens sent per request that ended",
            buckets=TOKEN_BUCKETS, registry=registry,
        )
        self.retries = Counter(
            "pdserve_router_retries", "Downstream calls retried on another worker", ["tier"], registry=registry,
        )
        self.kv_pulls = Counter(
            "pdserve_router_kv_pulls", "KV pull outcomes reported by decode pods", ["outcome"], registry=registry,
        )
        self.route_decisions = Counter(
            "pdserve_router_route_decisions",
            "Requests by route (split: prefill then decode; decode_only: the decode pod computes the prompt) "
            "and the reason for it", ["route", "reason"], registry=registry,
        )

    def watch_workers(self, tiers: dict[str, Callable[[], Iterable[tuple[str, bool]]]]) -> None:
        """Export each tier's rotation set as it is at every scrape: tier -> (address, is_healthy) pairs.
        Who scales pods (`pdserve up --autoscale`) reads it to know a pod left the rotation before it stops it."""
        self.registry.register(_RotationCollector(tiers))


class _RotationCollector:
    def __init__(self, tiers: dict[str, Callable[[], Iterable[tuple[str, bool]]]]):
        self._tiers = tiers

    def collect(self):
        family = GaugeMetricFamily(
            "pdserve_router_workers", "Workers in the router's rotation set (1 healthy, 0 not yet or no longer)",
            labels=["tier", "address"])
        for tier, workers in self._tiers.items():
            for address, is_healthy in workers():
                family.add_metric([tier, address], 1.0 if is_healthy else 0.0)
        yield family
