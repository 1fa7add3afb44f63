"""Pure worker-selection policies: least-loaded and round-robin over a snapshot of worker state."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, Sequence

from shared.serving.wire import LoadReport


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


def load_key(worker: WorkerView) -> tuple:
    """Lower is less loaded. The router's own in-flight count is fresh, the polled count includes other
    routers' requests but is stale; the larger of the two is the best estimate of the queue. Ties go to
    the worker with the larger free fraction of its KV pool, then to the address for determinism."""
    polled = 0
    free_fraction = 0.0
    if worker.load is not None:
        polled = worker.load.num_waiting + worker.load.num_running
        if worker.load.num_total_blocks:
            free_fraction = worker.load.num_free_blocks / worker.load.num_total_blocks
    return (max(polled, worker.num_inflight), -free_fraction, worker.address)


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


def pick(policy: str, workers: Sequence[WorkerView], turn: int, exclude: Collection[str] = ()) -> Pick:
    if policy == "least-loaded":
        return pick_least_loaded(workers, exclude)
    if policy == "round-robin":
        return pick_round_robin(workers, turn, exclude)
    raise ValueError(f"unknown policy {policy!r}")
