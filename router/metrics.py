"""The router's Prometheus metrics, on a registry the composition root owns (no global registry)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.serving.metrics import TTFT_BUCKETS_S
from shared.serving.outcomes import OUTCOMES



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
