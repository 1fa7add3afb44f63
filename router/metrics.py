"""The router's Prometheus metrics, on a registry the composition root owns (no global registry)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter(
            "pdserve_router_requests", "Generate calls by outcome (ok, cancelled, or a gRPC status)",
            ["outcome"], registry=registry,
        )
        self.ttft_seconds = Histogram(
            "pdserve_router_ttft_seconds", "Time from the Generate call to token 1 leaving the router",
            buckets=TTFT_BUCKETS, registry=registry,
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
