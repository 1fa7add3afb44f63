"""The planning loop: every interval, scrape the router and the pods, turn the readings into a
Sample, let the Planner decide, then publish the counts (KEDA, a local actuator), the metrics and a log line."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from planner.decision import Decision, Planner
from planner.keda_scaler import DesiredReplicas
from planner.metrics import PlannerMetrics
from planner.readings import Reading, build_sample
from planner.scrape import Target, scrape

logger = logging.getLogger("planner")

Actuator = Callable[[Decision], Awaitable[None]]


class PlanningLoop:
    def __init__(self, planner: Planner, sources: dict[str, tuple[Target, ...]], desired: DesiredReplicas,
                 metrics: PlannerMetrics, scrape_timeout_s: float, actuator: Actuator | None = None) -> None:
        self.planner = planner
        self.sources = sources  # "router", "prefill", "decode" -> targets
        self.desired = desired
        self.metrics = metrics
        self.scrape_timeout_s = scrape_timeout_s
        self.actuator = actuator
        self._before: dict[str, dict[str, Reading]] = {name: {} for name in sources}
        self._before_at: float | None = None
        self.last_decision: Decision | None = None

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - one bad interval must not end the planner
                logger.exception("planning step failed")
            await asyncio.sleep(max(0.0, self.planner.policy.interval_s - (time.monotonic() - started)))

    async def step(self) -> Decision | None:
        """One interval; None on the first call (it only takes the baseline readings)."""
        now_at = time.monotonic()
        readings = {}
        for name, targets in self.sources.items():
            readings[name], failed = await scrape(targets, self.scrape_timeout_s)
            for address in failed:
                self.metrics.scrape_failures.labels(source=name).inc()
                logger.warning("planner: %s metrics at %s did not answer", name, address)
        before, before_at = self._before, self._before_at
        self._before, self._before_at = readings, now_at
        if before_at is None or not readings["router"]:
            return None
        sample = build_sample(now_at - before_at, (readings["router"], before["router"]),
                              (readings["prefill"], before["prefill"]), (readings["decode"], before["decode"]))
        decision = self.planner.observe(sample, now_at)
        await self.publish(decision)
        return decision

    async def publish(self, decision: Decision) -> None:
        self.last_decision = decision
        await self.desired.publish(decision.prefill.desired, decision.decode.desired)
        self.metrics.record(decision)
        for made in (decision.prefill, decision.decode):
            logger.info("planner decision: %s", made.explain())
        if self.actuator is not None:
            await self.actuator(decision)
