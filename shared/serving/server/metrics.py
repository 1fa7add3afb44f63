"""Prometheus metrics for pdserve services: one CollectorRegistry per service (never the global
default, so several services can live in one test process) and a stoppable HTTP endpoint."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_wsgi_server

from shared.serving.pod.outcomes import OUTCOMES

NAMESPACE = "pdserve"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServiceMetrics:
    """The metrics one service exports. Create one per service; every metric lives in
    `self.registry`. Names carry the `pdserve_` prefix (counters gain `_total` on export)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._reads_seen = (0, 0)  # the connector's READ totals already counted
        self._add_request_metrics(self.registry)
        self._add_kv_metrics(self.registry)
        self._add_engine_metrics(self.registry)
        self.requests = Counter(
            "requests", "Finished requests by outcome.", ["outcome"],
            namespace=NAMESPACE, registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self._add_gateway_gauges(self.registry)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Latency and queue of the requests."""
        self.ttft_seconds = Histogram(
            "ttft_seconds", "Time to first token, request arrival to first token sent.",
            namespace=NAMESPACE, buckets=TTFT_BUCKETS_S, registry=r,
        )
        self.tpot_seconds = Histogram(
            "tpot_seconds", "Time per output token after the first, per request (mean).",
            namespace=NAMESPACE, buckets=TPOT_BUCKETS_S, registry=r,
        )
        self.queue_depth = Gauge(
            "queue_depth", "Requests waiting to be scheduled.", namespace=NAMESPACE, registry=r,
        )
        self.running_requests = Gauge(
            "running_requests", "Requests being computed.", namespace=NAMESPACE, registry=r,
        )
    def _add_kv_metrics(self, r: CollectorRegistry) -> None:
        """The KV pool, the holds for peers and the transfers between pods."""
        self.kv_blocks_used = Gauge(
            "kv_blocks_used", "KV cache blocks in use.", namespace=NAMESPACE, registry=r,
        )
        self.kv_blocks_free = Gauge(
            "kv_blocks_free", "KV cache blocks free.", namespace=NAMESPACE, registry=r,
        )
        self.kv_blocks_held_for_peer = Gauge(
            "kv_blocks_held_for_peer", "KV blocks held under a lease until a peer pulls them.",
            namespace=NAMESPACE, registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "kv_transfer_bytes", "KV bytes transferred between pods.",
            namespace=NAMESPACE, registry=r,
        )
        self.kv_reads = Counter(
            "kv_reads", "NIXL READs posted to pull KV, their data used or discarded.",
            namespace=NAMESPACE, registry=r,
        )
        self.kv_transfer_seconds = Counter(
            "kv_transfer_seconds", "Wall time spent on KV transfers.",
            namespace=NAMESPACE, registry=r,
        )
        self.kv_pulls = Counter(
            "kv_pulls", "KV pulls by the UCX transport they took and their outcome.", ["transport", "outcome"],
            namespace=NAMESPACE, registry=r,
        )
        self.kv_transport_failures = Counter(
            "kv_transport_failures", "Probe READs to a newly met prefill engine that did not deliver.",
            ["transport"], namespace=NAMESPACE, registry=r,
        )
        self.lease_expiries = Counter(
            "lease_expiries", "KV holds freed because their lease expired before release.",
            namespace=NAMESPACE, registry=r,
        )

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """The prefix cache and the engine's work."""
        self.prefix_cache_queried_tokens = Counter(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
            namespace=NAMESPACE, registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed or pulled again).",
            namespace=NAMESPACE, registry=r,
        )
        # The engine's work, for capacity planning (planner/): tokens per busy second is the pod's speed.
        self.engine_steps = Counter(
            "engine_steps", "Engine steps that computed tokens.", namespace=NAMESPACE, registry=r,
        )
        self.engine_tokens = Counter(
            "engine_tokens", "Tokens the engine computed (prompt chunks, decodes, drafts).",
            namespace=NAMESPACE, registry=r,
        )
        self.engine_busy_seconds = Counter(
            "engine_busy_seconds", "Wall time of the engine steps that computed tokens.", namespace=NAMESPACE, registry=r,
        )

    def _add_gateway_gauges(self, r: CollectorRegistry) -> None:
        # The gauges the Gateway API Inference Extension's endpoint picker scrapes (its model-server
        # protocol), under vLLM's names so an unmodified picker config finds them.
        self.gateway_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled (inference gateway protocol).",
            registry=r,
        )
        self.gateway_running = Gauge(
            "vllm:num_requests_running", "Requests being computed (inference gateway protocol).", registry=r,
        )
        self.gateway_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache utilization as a ratio in [0, 1] (inference gateway protocol).",
            registry=r,
        )
        # Older picker releases read the KV-cache ratio under this name.
        self.gateway_kv_usage_legacy = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache utilization as a ratio in [0, 1] (older gateway name).",
            registry=r,
        )

    def record_outcome(self, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        self.requests.labels(outcome=outcome).inc()

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes < 0 or seconds < 0:
            raise ValueError(f"transfer bytes and seconds must be >= 0, got {num_bytes}, {seconds}")
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_seconds.inc(seconds)

    def catch_up_kv_reads(self, num_reads: int, num_read_bytes: int) -> None:
        """The connector's READ totals (kept on the engine thread) into kv_reads and kv_transfer_bytes: every
        READ and its bytes, also those of a pull whose data was discarded or whose request ended mid-READ."""
        seen_reads, seen_bytes = self._reads_seen
        self.kv_reads.inc(num_reads - seen_reads)
        self.kv_transfer_bytes.inc(num_read_bytes - seen_bytes)
        self._reads_seen = (num_reads, num_read_bytes)

    def set_kv_blocks(self, *, num_used: int, num_free: int, num_held_for_peer: int) -> None:
        self.kv_blocks_used.set(num_used)
        self.kv_blocks_free.set(num_free)
        self.kv_blocks_held_for_peer.set(num_held_for_peer)
        num_total = num_used + num_free
        usage = num_used / num_total if num_total else 0.0
        self.gateway_kv_usage.set(usage)
        self.gateway_kv_usage_legacy.set(usage)

    def set_queue(self, *, num_waiting: int, num_running: int) -> None:
        self.queue_depth.set(num_waiting)
        self.running_requests.set(num_running)
        self.gateway_waiting.set(num_waiting)
        self.gateway_running.set(num_running)


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint; `port` is the bound port (useful with port 0)."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the port. Safe to call twice."""
        if not self._thread.is_alive():
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread. Port 0 picks a free one."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    server, thread = start_wsgi_server(port, addr=host, registry=registry)
    return MetricsServer(host=host, port=server.server_port, _server=server, _thread=thread)
