"""A discrete-event simulation of a split deployment (router, prefill pods, decode pods) whose pods
follow service curves measured from the real engine (benchmarks/measure_service_curves.py), scaled
either by a fixed count or by the planner's own decision code (planner.decision.Planner)."""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from planner.decision import Planner
from planner.sample import Sample, TierSample


@dataclass
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_generated: int = 0  # decode tokens after token 1
    num_blocks: int = 0  # KV blocks it holds on its decode pod

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


class Curves:
    """Least-squares fits to the measured points (a shared, noisy machine scatters single points):
    prefill seconds = a + b * P + c * P^2 (attention grows with the prompt), decode step seconds =
    a + b * batch + c * batch * context (weights, then attention over each request's context)."""

    def __init__(self, measured: dict) -> None:
        prefill = [(row["prompt_tokens"], row["seconds"]) for row in measured["prefill"]]
        decode = [(row["batch"], row["context"], row["seconds"]) for row in measured["decode"]]
        self.prefill_coefficients = _least_squares([[1.0, p, p * p] for p, _ in prefill], [s for _, s in prefill])
        self.decode_coefficients = _least_squares([[1.0, b, b * c] for b, c, _ in decode], [s for _, _, s in decode])
        self.block_size = measured["block_size"]
        self.num_blocks = measured["num_blocks"]
        self.max_num_seqs = measured["max_num_seqs"]

    def prefill_s(self, prompt_tokens: float) -> float:
        a, b, c = self.prefill_coefficients
        return max(1e-4, a + b * prompt_tokens + c * prompt_tokens ** 2)

    def decode_step_s(self, batch: float, context: float) -> float:
        a, b, c = self.decode_coefficients
        return max(1e-4, a + b * batch + c * batch * context)

    def describe(self) -> str:
        pa, pb, pc = self.prefill_coefficients
        da, db, dc = self.decode_coefficients
        return (f"prefill = {pa * 1000:.1f} ms + {pb * 1e6:.1f} us/token + {pc * 1e9:.3f} ns/token^2; decode step = "
                f"{da * 1000:.2f} ms + {db * 1000:.3f} ms/request + {dc * 1e6:.3f} us/(request*context token)")


def _least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """Non-negative least squares of the relative error (each point weighs the same, short or long), a
    negative term dropped and the rest refitted."""
    import numpy

    rows = [[x / value for x in row] for row, value in zip(rows, values)]
    values = [1.0] * len(values)

    active = list(range(len(rows[0])))
    while active:
        matrix = numpy.array([[row[i] for i in active] for row in rows])
        solution, *_ = numpy.linalg.lstsq(matrix, numpy.array(values), rcond=None)
        if (solution >= 0).all():
            result = [0.0] * len(rows[0])
            for index, value in zip(active, solution):
                result[index] = float(value)
            return result
        active.pop(int(numpy.argmin(solution)))
    return [0.0] * len(rows[0])


@dataclass
class Pod:
    tier: str
    ready_s: float
    started_s: float
    is_draining: bool = False
    removed_s: float | None = None
    queue: list = field(default_factory=list)  # prefill: FIFO of requests; decode: waiting for KV room
    running: list = field(default_factory=list)  # decode: the batch
    busy_until_s: float = 0.0
    blocks_used: int = 0

    def work(self) -> float:
        return len(self.queue) + len(self.running)


class Simulation:
    """Replays requests; every interval_s it builds the Sample the service would scrape and asks `planner`
    (None: fixed counts). Pods take startup_s to become ready; a drained pod takes no new request and
    leaves when its last request ends."""

    def __init__(self, curves: Curves, requests: list[SimRequest], *, num_prefill: int, num_decode: int,
                 planner: Planner | None, interval_s: float, startup_s: float) -> None:
        self.curves, self.requests, self.planner = curves, requests, planner
        self.interval_s, self.startup_s = interval_s, startup_s
        self.events: list = []
        self._order = itertools.count()
        self.pods = [Pod("prefill", 0.0, 0.0) for _ in range(num_prefill)] + [
            Pod("decode", 0.0, 0.0) for _ in range(num_decode)]
        self.timeline: list[dict] = []
        self.decisions: list = []
        self._interval = self._fresh_interval()

    def _fresh_interval(self) -> dict:
        return {"arrivals": 0, "prompt_tokens": 0, "finished": 0, "output_tokens": 0, "ttfts": [], "tpots": [],
                "prefill_ttfts": [], "busy": {"prefill": 0.0, "decode": 0.0}, "steps": {"prefill": 0, "decode": 0},
                "tokens": {"prefill": 0, "decode": 0}}

    def at(self, time_s: float, action, *args) -> None:
        heapq.heappush(self.events, (time_s, next(self._order), action, args))

    def run(self) -> None:
        for request in self.requests:
            self.at(request.arrival_s, self._arrive, request)
        end_s = self.requests[-1].arrival_s + 120.0
        tick = self.interval_s
        while tick <= end_s:
            self.at(tick, self._tick)
            tick += self.interval_s
        while self.events:
            now, _, action, args = heapq.heappop(self.events)
            action(now, *args)
        for pod in self.pods:
            if pod.removed_s is None:
                pod.removed_s = max(end_s, pod.busy_until_s)

    # ---- pods ---------------------------------------------------------------------------------
    def _ready(self, tier: str, now: float) -> list[Pod]:
        return [p for p in self.pods if p.tier == tier and p.ready_s <= now and not p.is_draining
                and p.removed_s is None]

    def _arrive(self, now: float, request: SimRequest) -> None:
        self._interval["arrivals"] += 1
        self._interval["prompt_tokens"] += request.prompt_tokens
        pods = self._ready("prefill", now) or [p for p in self.pods if p.tier == "prefill" and p.removed_s is None]
        pod = min(pods, key=lambda p: (sum(r.prompt_tokens for r in p.queue), p.busy_until_s))
        pod.queue.append(request)
        if len(pod.queue) == 1:
            self._start_prefill(pod, max(now, pod.ready_s))

    def _start_prefill(self, pod: Pod, now: float) -> None:
        if pod.ready_s <= now:
            request = pod.queue[0]
            seconds = self.curves.prefill_s(request.prompt_tokens)
            pod.busy_until_s = now + seconds
            self._interval["busy"]["prefill"] += seconds
            self._interval["steps"]["prefill"] += math.ceil(request.prompt_tokens / 4096)
            self._interval["tokens"]["prefill"] += request.prompt_tokens
            self.at(now + seconds, self._prefilled, pod)
        else:
            self.at(pod.ready_s, self._start_prefill, pod)

    def _prefilled(self, now: float, pod: Pod) -> None:
        request = pod.queue.pop(0)
        request.first_token_s = now
        self._interval["ttfts"].append(now - request.arrival_s)
        if request.output_tokens <= 1:
            self._finish(now, request)
        else:
            self._to_decode(now, request)
        if pod.queue:
            self._start_prefill(pod, now)
        elif pod.is_draining:
            pod.removed_s = now

    def _to_decode(self, now: float, request: SimRequest) -> None:
        pods = self._ready("decode", now) or [p for p in self.pods if p.tier == "decode" and p.removed_s is None]
        pod = min(pods, key=Pod.work)
        pod.queue.append(request)
        if not pod.running and len(pod.queue) == 1:
            self.at(max(now, pod.ready_s), self._decode_step, pod)

    def _blocks(self, request: SimRequest) -> int:
        return math.ceil((request.prompt_tokens + request.num_generated + 1) / self.curves.block_size)

    def _resize(self, pod: Pod, request: SimRequest) -> None:
        blocks = self._blocks(request)
        pod.blocks_used += blocks - request.num_blocks
        request.num_blocks = blocks

    def _decode_step(self, now: float, pod: Pod) -> None:
        if now < pod.busy_until_s:
            return  # a step is already under way
        while pod.queue and len(pod.running) < self.curves.max_num_seqs and (
                pod.blocks_used + self._blocks(pod.queue[0]) + len(pod.running) < self.curves.num_blocks):
            admitted = pod.queue.pop(0)
            pod.running.append(admitted)
            self._resize(pod, admitted)
        if not pod.running:
            if pod.is_draining and not pod.queue:
                pod.removed_s = now
            return
        batch = len(pod.running)
        context = sum(r.prompt_tokens + r.num_generated for r in pod.running) / batch
        seconds = self.curves.decode_step_s(batch, context)
        pod.busy_until_s = now + seconds
        self._interval["busy"]["decode"] += seconds
        self._interval["steps"]["decode"] += 1
        self._interval["tokens"]["decode"] += batch
        self.at(now + seconds, self._decoded, pod)

    def _decoded(self, now: float, pod: Pod) -> None:
        still = []
        for request in pod.running:
            request.num_generated += 1
            if request.num_generated + 1 >= request.output_tokens:
                pod.blocks_used -= request.num_blocks
                request.num_blocks = 0
                self._finish(now, request)
            else:
                self._resize(pod, request)
                still.append(request)
        pod.running = still
        self._decode_step(now, pod)

    def _finish(self, now: float, request: SimRequest) -> None:
        request.finish_s = now
        self._interval["finished"] += 1
        self._interval["output_tokens"] += request.output_tokens
        self._interval["tpots"].append(request.tpot_s)

    # ---- the planner's interval ---------------------------------------------------------------
    def _tier_sample(self, tier: str, now: float) -> TierSample:
        ready = [p for p in self.pods if p.tier == tier and p.ready_s <= now and p.removed_s is None]
        interval = self._interval
        tier_sample = TierSample(
            num_pods=len(ready), busy_s=interval["busy"][tier], num_steps=interval["steps"][tier],
            num_tokens=interval["tokens"][tier],
            num_waiting=sum(len(p.queue) for p in ready) - (sum(1 for p in ready if p.queue) if tier == "prefill" else 0),
            num_running=sum(len(p.running) for p in ready) + (sum(1 for p in ready if p.queue) if tier == "prefill" else 0),
        )
        if tier == "prefill":
            return tier_sample
        return TierSample(**{**tier_sample.__dict__, "kv_blocks_used": sum(p.blocks_used for p in ready),
                             "kv_blocks_total": self.curves.num_blocks * len(ready),
                             "latency_p90_s": _p90(interval["tpots"])})

    def _tick(self, now: float) -> None:
        interval = self._interval
        counts = {tier: sum(1 for p in self.pods if p.tier == tier and p.removed_s is None and not p.is_draining)
                  for tier in ("prefill", "decode")}
        row = {"time_s": now, "prefill_pods": counts["prefill"], "decode_pods": counts["decode"],
               "ttft_p90_s": _p90(interval["ttfts"]), "tpot_p90_s": _p90(interval["tpots"])}
        if self.planner is not None:
            sample = Sample(
                interval_s=self.interval_s, num_arrivals=interval["arrivals"], num_prompt_tokens=interval["prompt_tokens"],
                num_finished=interval["finished"], num_output_tokens=interval["output_tokens"],
                prefill=self._tier_sample("prefill", now), decode=self._tier_sample("decode", now),
                ttft_p90_s=_p90(interval["ttfts"]),
            )
            decision = self.planner.observe(sample, now)
            self.decisions.append(decision)
            for tier in ("prefill", "decode"):
                self._scale(tier, decision.tier(tier).desired, now)
            row.update(prefill_desired=decision.prefill.desired, decode_desired=decision.decode.desired)
        self.timeline.append(row)
        self._interval = self._fresh_interval()

    def _scale(self, tier: str, desired: int, now: float) -> None:
        live = [p for p in self.pods if p.tier == tier and p.removed_s is None and not p.is_draining]
        for _ in range(desired - len(live)):
            self.pods.append(Pod(tier, now + self.startup_s, now))
        for pod in sorted(live, key=lambda p: (p.ready_s <= now, p.work()))[:max(0, len(live) - desired)]:
            pod.is_draining = True  # a pod still starting goes first; then the least busy
            if not pod.queue and not pod.running and pod.busy_until_s <= now:
                pod.removed_s = now
            # A prefill pod drains its queue; a decode pod finishes its batch and its queue (no request lost).

    # ---- results ------------------------------------------------------------------------------
    def pod_seconds(self) -> float:
        return sum(p.removed_s - p.started_s for p in self.pods)

    def attainment(self, ttft_target_s: float, itl_target_s: float, after_s: float = 0.0) -> float:
        """Share of the requests arriving after `after_s` that ended within both targets."""
        scored = [r for r in self.requests if r.arrival_s >= after_s]
        met = sum(1 for r in scored if r.finish_s is not None and r.first_token_s - r.arrival_s <= ttft_target_s
                  and r.tpot_s <= itl_target_s)
        return met / len(scored)

    def num_unfinished(self) -> int:
        return sum(1 for r in self.requests if r.finish_s is None)


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
