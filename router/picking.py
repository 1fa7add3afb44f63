"""How the router picks a worker of a tier for one request (its policy over the pods' health, load and cached
prefixes, traced), whether the request is split at all, and the error when no worker can be had."""
from __future__ import annotations

import grpc
from opentelemetry import trace

from router.flags import RouterConfig
from router.kv_index import KvIndex, PromptHashes
from router.metrics import RouterMetrics
from router.policy import NoPick, Pick, Route, RouteDecision, RouteReason, decide_route, pick
from router.retry import Stalled, retry_after_s
from router.route_call import RouteError
from router.workers import WorkerPool


class Picker:
    """Picks for both tiers; round-robin turns are kept per tier."""

    def __init__(self, config: RouterConfig, tracer: trace.Tracer, kv_index: KvIndex | None,
                 metrics: RouterMetrics | None, tiers: tuple[str, ...]):
        self._config = config
        self._tracer = tracer
        self._kv_index = kv_index
        self._metrics = metrics
        self._turns = dict.fromkeys(tiers, 0)

    def pick(self, pool: WorkerPool, exclude: list[str], prompt: PromptHashes) -> Pick:
        turn = self._turns[pool.tier]
        self._turns[pool.tier] = turn + 1
        with self._tracer.start_as_current_span(f"route {pool.tier}") as span:
            views = pool.views()
            cached = self.cached_tokens(views, prompt) if self._config.policy == "kv-aware" else {}
            choice = pick(self._config.policy, views, turn, exclude, num_prompt_tokens=prompt.num_tokens,
                          cached_tokens=cached, weights=self._config.kv_weights)
            span.set_attribute("pdserve.policy", self._config.policy)
            span.set_attribute("pdserve.worker", choice.address or "")
            if choice.address is not None and cached:
                span.set_attribute("pdserve.kv.cached_tokens", cached.get(choice.address, 0))
            span.set_attribute("pdserve.excluded", list(exclude))
            if choice.reason is not None:
                span.set_attribute("pdserve.no_pick", choice.reason.value)
        return choice

    def cached_tokens(self, views, prompt: PromptHashes) -> dict[str, int]:
        if self._kv_index is None:
            return {}
        return self._kv_index.cached_tokens_by_pod((v.address for v in views if v.is_healthy), prompt)

    def decide(self, prompt: PromptHashes, prefill: WorkerPool, decode: WorkerPool) -> RouteDecision:
        """Split, or decode-only when the decode pod this request would go to lacks little of the prompt
        (or prefill is saturated); recorded on the route span and in a metric."""
        rule = self._config.disaggregation
        num_uncached = prompt.num_tokens
        decision = RouteDecision(Route.SPLIT, RouteReason.PREFILL_NEEDED)
        with self._tracer.start_as_current_span("route decision") as span:
            if rule.max_local_prefill_tokens > 0 or rule.saturation_queue > 0:
                views = decode.views()
                cached = self.cached_tokens(views, prompt)
                choice = pick(self._config.policy, views, self._turns[decode.tier],
                              num_prompt_tokens=prompt.num_tokens, cached_tokens=cached,
                              weights=self._config.kv_weights)
                decode_view = next((v for v in views if v.address == choice.address), None)
                if decode_view is not None:
                    num_uncached = prompt.num_tokens - cached.get(decode_view.address, 0)
                decision = decide_route(num_uncached, prefill.views(), decode_view, rule)
            span.set_attribute("pdserve.route", decision.route.value)
            span.set_attribute("pdserve.route.reason", decision.reason.value)
            span.set_attribute("pdserve.route.num_uncached_tokens", num_uncached)
        server_span = trace.get_current_span()
        server_span.set_attribute("pdserve.route", decision.route.value)
        server_span.set_attribute("pdserve.route.reason", decision.reason.value)
        if self._metrics is not None:
            self._metrics.route_decisions.labels(route=decision.route.value, reason=decision.reason.value).inc()
        return decision


def no_pick_error(pool: WorkerPool, reason: NoPick | None, last_error, tried: list[str]) -> RouteError:
    """The status a request ends with when no worker of the tier took it (last_error: the last refusal)."""
    where = ", ".join(tried) or None
    attempts = f"{pool.tier} failed on {len(tried)} worker{'s' if len(tried) != 1 else ''}"
    if isinstance(last_error, Stalled):
        return RouteError(grpc.StatusCode.UNAVAILABLE, f"{attempts}: {last_error}", where)
    if last_error is not None:
        hint_s = retry_after_s(last_error) if last_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        return RouteError(last_error.code(), f"{attempts}: {last_error.details()}", where, hint_s)
    if reason is NoPick.ALL_OVERLOADED:
        return RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"every {pool.tier} worker is overloaded",
                          retry_after_s=pool.retry_after_s())
    return RouteError(
        grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.tier} worker ({len(pool.addresses)} known)",
        ", ".join(pool.addresses) or None,
    )
