"""The local pods `pdserve up --autoscale` scales: each tier's pods started and drained on this machine. The
router's rotation is a worker list file per tier (the router re-reads it); a pod joins it once it serves, and
is stopped only after the router has taken it out and it has finished its requests."""
from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import LocalCluster, ServiceProcess, wait_serving
from planner.decision import TIERS, Decision
from planner.scrape import Target, parse_target

logger = logging.getLogger("pdserve.autoscale")

MODULES = {"prefill": "prefill_svc", "decode": "decode_svc"}
ROTATION_METRIC = "pdserve_router_workers"  # router/metrics.py: tier and address of each worker it routes to
ROTATION_POLL_S = 0.2
# Beyond a pod's drain period: the time its shutdown takes after the drain (the engine thread, NIXL).
EXIT_MARGIN_S = 15.0


class PodState(enum.Enum):
    STARTING = "starting"  # loading; not in the rotation yet
    SERVING = "serving"  # in the router's worker list
    DRAINING = "draining"  # out of the list, finishing its requests, then stopped


@dataclass
class LocalPod:
    tier: str
    service: ServiceProcess
    state: PodState = PodState.STARTING


@dataclass(frozen=True)
class PodTimings:
    drain_s: float  # a pod's --grace-seconds: how long its requests may take to finish once it is stopped
    start_timeout_s: float = 600.0  # loading a model (a cold machine, a real checkpoint) takes a while
    rotation_timeout_s: float = 30.0  # how long the router may take to re-read a worker list


class LocalPods:
    """Pods of both tiers as processes of `cluster`. `scale_to` starts or drains pods in the background (a
    change takes seconds to minutes; the planner keeps deciding meanwhile); on_change is called whenever the
    set of pods serving or draining changes (the planner scrapes their metrics)."""

    def __init__(self, cluster: LocalCluster, tier_args: dict[str, Sequence[str]], log_dir: Path,
                 timings: PodTimings, on_change: Callable[[], None] | None = None) -> None:
        self.cluster = cluster
        self.tier_args = tier_args
        self.log_dir = log_dir
        self.timings = timings
        self.on_change = on_change
        self.router_metrics_url: str | None = None  # set once the router runs: joins and leaves are then confirmed
        self.pods: list[LocalPod] = []
        self.num_failed_starts = 0
        self._num_started = dict.fromkeys(TIERS, 0)  # pod names are never reused: each keeps its own log
        self._tasks: set[asyncio.Task] = set()

    def list_file(self, tier: str) -> Path:
        return self.log_dir / f"{tier}.pods"

    def of(self, tier: str, *states: PodState) -> list[LocalPod]:
        return [pod for pod in self.pods if pod.tier == tier and (not states or pod.state in states)]

    def metrics_targets(self, tier: str) -> tuple[Target, ...]:
        """Where the planner reads the tier's pods: those serving and those still draining."""
        pods = self.of(tier, PodState.SERVING, PodState.DRAINING)
        return tuple(parse_target(p.service.metrics_url.removeprefix("http://").removesuffix("/metrics"))
                     for p in pods if p.service.metrics_url)

    async def start_initial(self, counts: dict[str, int]) -> None:
        """The first pods, all at once, before the router exists; RuntimeError if one does not start."""
        for tier in TIERS:
            self.list_file(tier).parent.mkdir(parents=True, exist_ok=True)
            self._write_list(tier)
        await asyncio.gather(*(self._until_serving(self._launch(tier)) for tier in TIERS for _ in range(counts[tier])))
        missing = [tier for tier in TIERS if len(self.of(tier, PodState.SERVING)) < counts[tier]]
        if missing:
            raise RuntimeError(f"the first {' and '.join(missing)} pod(s) did not start (see {self.log_dir}/)")

    async def apply(self, decision: Decision) -> None:
        """The planning loop's actuator."""
        for tier in TIERS:
            self.scale_to(tier, decision.tier(tier).desired)

    def scale_to(self, tier: str, count: int) -> None:
        """Starts or drains pods until `count` are starting or serving. Pods still starting go first (they
        hold no request: stopped at once), then serving ones, the newest first, each drained."""
        active = self.of(tier, PodState.STARTING, PodState.SERVING)
        for _ in range(count - len(active)):
            self._spawn(self._until_serving(self._launch(tier)))
        surplus = max(0, len(active) - count)
        leaving = [*reversed(self.of(tier, PodState.STARTING)), *reversed(self.of(tier, PodState.SERVING))]
        for pod in leaving[:surplus]:
            was_serving = pod.state is PodState.SERVING
            pod.state = PodState.DRAINING  # now, so the next decision does not pick it again
            self._spawn(self.drain(pod) if was_serving else self._stop_starting(pod))

    async def settled(self) -> None:
        """Waits until every start and drain in progress has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Stops every pod (each drains its requests on SIGTERM); starts and drains in progress are cut short."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(p.service.stop, self._stop_timeout_s()) for p in list(self.pods)))

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _launch(self, tier: str) -> LocalPod:
        """The pod's process, started now (so the next decision counts it)."""
        name = f"{tier}-{self._num_started[tier]}"
        self._num_started[tier] += 1
        service = self.cluster.start_process(name, MODULES[tier], list(self.tier_args[tier]), self.log_dir,
                                             self.cluster.env)
        pod = LocalPod(tier, service)
        self.pods.append(pod)
        return pod

    async def _until_serving(self, pod: LocalPod) -> None:
        """Into the worker list once its health says SERVING (and the router's rotation, when there is one)."""
        service, name, tier = pod.service, pod.service.name, pod.tier
        began = time.monotonic()
        try:
            await asyncio.to_thread(wait_serving, service, self.timings.start_timeout_s, self.cluster.client_tls)
        except RuntimeError as exc:
            if pod.state is PodState.STARTING:  # not stopped on purpose (_stop_starting)
                self.num_failed_starts += 1
                logger.error("autoscale: %s did not start: %s", name, str(exc).splitlines()[0])
                await asyncio.to_thread(service.stop)
                self._forget(pod)
            return
        if pod.state is not PodState.STARTING:
            return  # no longer wanted: _stop_starting stops it
        pod.state = PodState.SERVING
        self._write_list(tier)
        joined = await self._wait_rotation(tier, service.address, present=True)
        logger.info("autoscale: %s (%s, pid %d) serving after %.1f s%s", name, service.address, service.pid,
                    time.monotonic() - began, "" if joined else "; the router has not confirmed it yet")
        self._changed()

    async def drain(self, pod: LocalPod) -> None:
        """Out of the router's rotation first, then SIGTERM: the pod finishes its requests (within its
        --grace-seconds) and exits."""
        began = time.monotonic()
        pod.state = PodState.DRAINING
        self._write_list(pod.tier)
        if not await self._wait_rotation(pod.tier, pod.service.address, present=False):
            logger.warning("autoscale: the router still routes to %s after %.0f s; stopping it anyway (a draining "
                           "pod refuses new work and the router retries it on another)", pod.service.name,
                           self.timings.rotation_timeout_s)
        left_at = time.monotonic()
        await asyncio.to_thread(pod.service.stop, self._stop_timeout_s())
        logger.info("autoscale: %s drained: out of the rotation in %.1f s, exited (code %s) %.1f s after SIGTERM",
                    pod.service.name, left_at - began, pod.service.process.returncode, time.monotonic() - left_at)
        self._forget(pod)

    async def _stop_starting(self, pod: LocalPod) -> None:
        """A pod no longer wanted before it serves: in no worker list, holding no request; stopped now."""
        await asyncio.to_thread(pod.service.stop)
        logger.info("autoscale: %s stopped before it served (no longer wanted)", pod.service.name)
        self._forget(pod)

    def _stop_timeout_s(self) -> float:
        return self.timings.drain_s + EXIT_MARGIN_S

    def _forget(self, pod: LocalPod) -> None:
        if pod in self.pods:
            self.pods.remove(pod)
        if pod.service in self.cluster.services:
            self.cluster.services.remove(pod.service)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _write_list(self, tier: str) -> None:
        """The tier's serving pods, one host:port a line, replaced whole (the router never reads half a file)."""
        path = self.list_file(tier)
        lines = [f"# {tier} pods in rotation, written by pdserve up --autoscale\n"]
        lines += [f"{pod.service.address}\n" for pod in self.of(tier, PodState.SERVING)]
        partial = path.with_suffix(".writing")
        partial.write_text("".join(lines))
        os.replace(partial, path)

    async def _wait_rotation(self, tier: str, address: str, *, present: bool) -> bool:
        """Until the router's rotation gauge shows the pod healthy in it (present) or gone from it; False on
        timeout. True at once while there is no router yet."""
        if self.router_metrics_url is None:
            return True
        deadline = time.monotonic() + self.timings.rotation_timeout_s
        while time.monotonic() < deadline:
            try:
                rotation = await asyncio.to_thread(read_rotation, self.router_metrics_url)
            except OSError:
                rotation = None  # the router is busy or restarting: ask again
            if rotation is not None and (rotation.get((tier, address)) == 1.0 if present
                                         else (tier, address) not in rotation):
                return True
            await asyncio.sleep(ROTATION_POLL_S)
        return False


def read_rotation(metrics_url: str, timeout_s: float = 2.0) -> dict[tuple[str, str], float]:
    """The router's rotation gauge: (tier, address) -> 1 healthy, 0 not."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {(s.labels["tier"], s.labels["address"]): s.value
            for family in text_string_to_metric_families(text) if family.name == ROTATION_METRIC
            for s in family.samples}
