"""Pure worker-selection policies over a snapshot of worker state: least-loaded, round-robin and
KV-aware (cached prefix against load), and the conditional-disaggregation decision."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from shared.serving.server.settings import setting
from shared.serving.wire.payloads import LoadReport


@dataclass(frozen=True)
class WorkerView:
    """What a policy may know about one worker at the moment of the pick."""

    address: str
    is_healthy: bool
    load: LoadReport | None = None  # last polled load; None until the first poll answers
    num_inflight: int = 0  # calls this router has open to the worker right now

    @property
    def is_overloaded(self) -> bool:
        return self.load is not None and self.load.is_overloaded


class NoPick(enum.Enum):
    """Why no worker could be chosen."""

    NO_WORKERS = "no healthy worker"
    ALL_OVERLOADED = "every healthy worker is overloaded"


@dataclass(frozen=True)
class Pick:
    address: str | None
    reason: NoPick | None = None


def candidates(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> tuple[list[WorkerView], NoPick | None]:
    """Healthy, not overloaded, not excluded workers, sorted by address; or why there are none."""
    healthy = [w for w in workers if w.is_healthy and w.address not in exclude]
    if not healthy:
        return [], NoPick.NO_WORKERS
    ready = sorted((w for w in healthy if not w.is_overloaded), key=lambda w: w.address)
    if not ready:
        return [], NoPick.ALL_OVERLOADED
    return ready, None


def queue_length(worker: WorkerView) -> int:
    """The router's own in-flight count is fresh, the polled count includes other routers' requests but
    is stale; the larger of the two is the best estimate of the worker's queue."""
    polled = 0 if worker.load is None else worker.load.num_waiting + worker.load.num_running
    return max(polled, worker.num_inflight)


def load_key(worker: WorkerView) -> tuple:
    """Lower is less loaded. Ties go to the worker with the larger free fraction of its KV pool, then
    to the address for determinism."""
    free_fraction = 0.0
    if worker.load is not None and worker.load.num_total_blocks:
        free_fraction = worker.load.num_free_blocks / worker.load.num_total_blocks
    return (queue_length(worker), -free_fraction, worker.address)


def pick_least_loaded(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> Pick:
    ready, reason = candidates(workers, exclude)
    if reason is not None:
        return Pick(None, reason)
    return Pick(min(ready, key=load_key).address)


def pick_round_robin(workers: Sequence[WorkerView], turn: int, exclude: Collection[str] = ()) -> Pick:
    """`turn` is a counter the caller increments per pick; the order is by address so it is stable."""
    ready, reason = candidates(workers, exclude)
    if reason is not None:
        return Pick(None, reason)
    return Pick(ready[turn % len(ready)].address)


@dataclass(frozen=True)
class KvWeights:
    """KV-aware cost of a worker: prefix_weight per prompt token it lacks in its prefix cache (prefill
    computes it, decode pulls it) plus load_weight per request in its queue."""

    prefix_weight: float = field(default=1.0, metadata=setting(
        "kv-aware: cost of one prompt token a pod lacks in its prefix cache (prefill computes, decode pulls it)",
        flag="--kv-prefix-weight",
    ))
    load_weight: float = field(default=64.0, metadata=setting(
        "kv-aware: cost of one request in a pod's queue, in the same units", flag="--kv-load-weight"
    ))

    def __post_init__(self) -> None:
        for name in ("prefix_weight", "load_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def kv_cost(worker: WorkerView, num_prompt_tokens: int, num_cached_tokens: int, weights: KvWeights) -> float:
    return weights.prefix_weight * (num_prompt_tokens - num_cached_tokens) + weights.load_weight * queue_length(worker)


def pick_kv_aware(
    workers: Sequence[WorkerView],
    num_prompt_tokens: int,
    cached_tokens: Mapping[str, int],
    weights: KvWeights,
    exclude: Collection[str] = (),
) -> Pick:
    """The worker with the lowest kv_cost (`cached_tokens`: leading prompt tokens each worker holds);
    ties go to the less loaded one."""
    ready, reason = candidates(workers, exclude)
    if reason is not None:
        return Pick(None, reason)

    def key(worker: WorkerView) -> tuple:
        cost = kv_cost(worker, num_prompt_tokens, cached_tokens.get(worker.address, 0), weights)
        return (cost, load_key(worker))

    return Pick(min(ready, key=key).address)


def pick(
    policy: str,
    workers: Sequence[WorkerView],
    turn: int,
    exclude: Collection[str] = (),
    *,
    num_prompt_tokens: int = 0,
    cached_tokens: Mapping[str, int] | None = None,
    weights: KvWeights = KvWeights(),
) -> Pick:
    if policy == "least-loaded":
        return pick_least_loaded(workers, exclude)
    if policy == "round-robin":
        return pick_round_robin(workers, turn, exclude)
    if policy == "kv-aware":
        return pick_kv_aware(workers, num_prompt_tokens, cached_tokens or {}, weights, exclude)
    raise ValueError(f"unknown policy {policy!r}")


# ---- conditional disaggregation -----------------------------------------------------------------

class Route(enum.Enum):
    SPLIT = "split"  # prefill pod computes the prompt, decode pod pulls its KV
    DECODE_ONLY = "decode_only"  # the decode pod computes the prompt itself


class RouteReason(enum.Enum):
    PREFILL_NEEDED = "prefill_needed"
    SHORT_UNCACHED_SUFFIX = "short_uncached_suffix"
    PREFILL_SATURATED = "prefill_saturated"


@dataclass(frozen=True)
class DisaggregationRule:
    """When to skip the prefill tier. 0 turns a rule off.
    max_local_prefill_tokens: a decode pod computes the prompt itself when it lacks fewer tokens than this.
    saturation_queue: prefill is saturated when every prefill worker has at least this many requests
    waiting (or is overloaded); the decode pod takes the prompt then if its own queue is shorter."""

    max_local_prefill_tokens: int = field(default=0, metadata=setting(
        "send a request straight to a decode pod that lacks fewer prompt tokens than this (0: off)",
        flag="--local-prefill-below",
    ))
    saturation_queue: int = field(default=0, metadata=setting(
        "prefill is saturated when every prefill pod has this many requests waiting; a decode pod with a "
        "shorter queue then computes the prompt itself (0: off)", flag="--prefill-saturation-queue",
    ))

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_tokens", "saturation_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    reason: RouteReason


def _waiting(worker: WorkerView) -> int:
    return 0 if worker.load is None else worker.load.num_waiting


def is_prefill_saturated(prefill_workers: Sequence[WorkerView], saturation_queue: int) -> bool:
    healthy = [w for w in prefill_workers if w.is_healthy]
    if saturation_queue <= 0 or not healthy:
        return False
    return all(w.is_overloaded or _waiting(w) >= saturation_queue for w in healthy)


def decide_route(
    num_uncached_tokens: int,
    prefill_workers: Sequence[WorkerView],
    decode_worker: WorkerView | None,
    rule: DisaggregationRule,
) -> RouteDecision:
    """Split or decode-only for one request. `num_uncached_tokens`: prompt tokens `decode_worker` (the
    decode pod it would go to) lacks in its prefix cache."""
    if decode_worker is None or decode_worker.is_overloaded:
        return RouteDecision(Route.SPLIT, RouteReason.PREFILL_NEEDED)
    if num_uncached_tokens < rule.max_local_prefill_tokens:
        return RouteDecision(Route.DECODE_ONLY, RouteReason.SHORT_UNCACHED_SUFFIX)
    if is_prefill_saturated(prefill_workers, rule.saturation_queue) and _waiting(decode_worker) < rule.saturation_queue:
        return RouteDecision(Route.DECODE_ONLY, RouteReason.PREFILL_SATURATED)
    return RouteDecision(Route.SPLIT, RouteReason.PREFILL_NEEDED)
