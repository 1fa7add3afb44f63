"""One tier's workers as the router knows them: discovery (host:port or DNS names re-resolved over time),
health (standard gRPC health Check) and load (GetLoad), plus one channel per worker."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import common_pb2
from router.flags import PoolConfig, WorkerSpec, format_address, read_worker_file
from router.policy import WorkerView
from shared.serving.wire.common import load_report_from_proto
from shared.serving.wire import payloads as wire
from shared.serving.server.tls import TlsConfig

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address a name resolves to, as host:port strings (sorted, deduplicated)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})


class Admission(enum.Enum):
    """What a fresh probe says of a worker for one new request."""

    ADMITTED = "admitted"
    OVERLOADED = "overloaded"  # alive, but busy past what it takes now: another worker, or later
    UNAVAILABLE = "unavailable"  # not serving, or silent while nothing shows it busy (frozen)


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class _Worker:
    address: str
    channel: grpc.aio.Channel  # request calls (carries the client interceptors)
    client: Any  # what the request calls go through
    probe_channel: grpc.aio.Channel  # health and load probes (untraced: they would bury the request traces)
    probe_stub: Any
    health_stub: health_pb2_grpc.HealthStub
    is_healthy: bool = False
    load: wire.LoadReport | None = None
    num_inflight: int = 0
    is_retired: bool = False
    overloaded_until: float | None = None  # monotonic time a refusal's retry hint runs out
    probe_problem: str | None = None  # why the last probe found it unhealthy (logged when it changes)
    num_slow_probes: int = 0  # consecutive probes that timed out
    last_heard: float = float("-inf")  # monotonic time a request call last got a message from it
    # Clear while a probe is in flight: closing the channels under it would cancel it inside a poll round.
    probe_done: asyncio.Event = field(default_factory=_set_event)


class WorkerPool:
    """Tracks the workers of one tier. `stub_class` is the tier's generated stub (the load probe calls
    its GetLoad); `client_class` wraps a worker's channel for the request calls (default: the stub);
    `service_name` is the name the workers report health under."""

    def __init__(
        self,
        tier: str,
        specs: Sequence[WorkerSpec],
        stub_class: Callable[[grpc.aio.Channel], Any],
        service_name: str,
        config: PoolConfig,
        *,
        client_class: Callable[[grpc.aio.Channel], Any] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] = (),  # client interceptors of the request calls (e.g. tracing)
        resolver: Resolver = resolve_dns,
        on_poll: Callable[[], Awaitable[None]] | None = None,
        tls: TlsConfig = TlsConfig(),
    ):
        self.tier = tier
        self.specs = tuple(specs)
        self.service_name = service_name
        self.config = config
        self._stub_class = stub_class
        self._client_class = client_class or stub_class
        self._channel_options = list(channel_options)
        self._interceptors = list(interceptors)
        self._resolver = resolver
        self._on_poll = on_poll
        self._tls = tls  # the channels to workers speak TLS when it holds a certificate or CA
        self._workers: dict[str, _Worker] = {}
        self._last_resolved: dict[WorkerSpec, list[str]] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolves and probes once (so the first request finds healthy workers), then keeps doing so."""
        await self.resolve()
        await self.poll()
        self._tasks.append(asyncio.create_task(self._every(self.config.health_interval_s, self.poll)))
        if any(spec.is_dynamic for spec in self.specs):
            self._tasks.append(asyncio.create_task(self._every(self.config.resolve_interval_s, self.resolve)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        workers, self._workers = list(self._workers.values()), {}
        await asyncio.gather(*(self._close(w) for w in workers), return_exceptions=True)

    async def _every(self, interval_s: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except Exception:  # noqa: BLE001 - a failed round must not end the loop
                logger.exception("%s pool: periodic %s failed", self.tier, action.__name__)

    # ---- discovery ----------------------------------------------------------------------------
    async def resolve(self) -> None:
        """Recomputes the worker set from the specs; a failed DNS lookup or an unreadable worker list file
        keeps that source's last answer."""
        addresses: list[str] = []
        for spec in self.specs:
            if not spec.is_dynamic:
                found = [format_address(spec.host, spec.port)]
            else:
                try:
                    found = (read_worker_file(spec.list_file) if spec.list_file is not None
                             else await self._resolver(spec.host, spec.port))
                except (OSError, ValueError) as exc:
                    found = self._last_resolved.get(spec, [])
                    logger.warning("%s pool: cannot resolve %s (%s); keeping %s", self.tier, spec, exc, found)
            self._last_resolved[spec] = found
            addresses.extend(a for a in found if a not in addresses)
        self._apply(addresses)

    def _apply(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self._workers:
                options = self._channel_options
                channel = self._tls.aio_channel(address, options=options, interceptors=self._interceptors or None)
                probe_channel = channel
                if self._interceptors:
                    probe_channel = self._tls.aio_channel(address, options=options)
                self._workers[address] = _Worker(
                    address, channel, self._client_class(channel), probe_channel, self._stub_class(probe_channel),
                    health_pb2_grpc.HealthStub(probe_channel),
                )
                logger.info("%s pool: added %s", self.tier, address)
        for address in [a for a in self._workers if a not in addresses]:
            worker = self._workers.pop(address)
            worker.is_retired = True
            logger.info("%s pool: removed %s", self.tier, address)
            if worker.num_inflight == 0:
                self._close_later(worker)

    @staticmethod
    async def _close(worker: _Worker) -> None:
        """Closes a worker's channels once its probe in flight, if any, has ended (within its timeouts)."""
        await worker.probe_done.wait()
        await worker.channel.close()
        if worker.probe_channel is not worker.channel:
            await worker.probe_channel.close()

    def _close_later(self, worker: _Worker) -> None:
        asyncio.get_running_loop().create_task(self._close(worker))

    # ---- health and load ----------------------------------------------------------------------
    async def poll(self) -> None:
        # One worker's probe failing in an unforeseen way must not cost the others their round.
        results = await asyncio.gather(*(self._probe(w) for w in list(self._workers.values())),
                                       return_exceptions=True)
        for error in (r for r in results if isinstance(r, BaseException)):
            logger.warning("%s pool: a probe ended with %r", self.tier, error)
        if self._on_poll is not None:
            await self._on_poll()

    async def _probe(self, worker: _Worker) -> None:
        worker.probe_done.clear()
        try:
            await self._check(worker)
        finally:
            worker.probe_done.set()

    async def _check(self, worker: _Worker) -> None:
        timeout = self.config.probe_timeout_s
        try:
            health = await worker.health_stub.Check(
                health_pb2.HealthCheckRequest(service=self.service_name), timeout=timeout
            )
            is_healthy = health.status == health_pb2.HealthCheckResponse.SERVING
            load = None
            if is_healthy:
                response = await worker.probe_stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout)
                load = load_report_from_proto(response.load)
        except grpc.aio.AioRpcError as exc:
            if self._tolerates_slow_probe(worker, exc):
                return  # its last state and load stand
            is_healthy, load, health = False, None, None
            self._note_problem(worker, f"probe failed: {exc.code().name}: {exc.details()}", logging.WARNING)
        worker.num_slow_probes = 0
        if health is not None and not is_healthy:  # loading or draining: normal for a while
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            self._note_problem(worker, f"health says {status}", logging.INFO)
        if is_healthy and not worker.is_healthy:
            logger.info("%s pool: %s is now healthy", self.tier, worker.address)
            worker.probe_problem = None
        worker.is_healthy, worker.load = is_healthy, load

    def _tolerates_slow_probe(self, worker: _Worker, error: grpc.aio.AioRpcError) -> bool:
        """Whether a healthy worker stays in rotation despite this probe timing out (not yet the configured
        number of timeouts in a row)."""
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED or not worker.is_healthy:
            return False
        worker.num_slow_probes += 1
        if worker.num_slow_probes >= self.config.slow_probes_to_unhealthy:
            return False
        logger.info("%s pool: %s answered no probe within %.1f s (%d in a row); kept in rotation", self.tier,
                    worker.address, self.config.probe_timeout_s, worker.num_slow_probes)
        return True

    def _note_problem(self, worker: _Worker, problem: str, level: int) -> None:
        """Say why a worker is unhealthy, once per cause: a TLS or address mistake shows in the log, not
        only as 'no healthy worker' to clients."""
        if problem != worker.probe_problem:
            logger.log(level, "%s pool: %s is unhealthy (%s)", self.tier, worker.address, problem)
            worker.probe_problem = problem

    # ---- what the servicer uses ---------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        """The smallest model length the tier's workers reported (None before any did)."""
        lengths = [w.load.max_model_len for w in self._workers.values() if w.load is not None and w.load.max_model_len]
        return min(lengths, default=None)

    @property
    def capacity(self) -> int | None:
        """How many requests the tier's workers admit at once, all together (None until every worker
        reported it): a request of more completions can never run whole."""
        limits = [w.load.max_requests_in_flight if w.load is not None else None for w in self._workers.values()]
        return sum(limits) if limits and None not in limits else None

    def views(self) -> list[WorkerView]:
        return [WorkerView(w.address, w.is_healthy, self._load_of(w), w.num_inflight) for w in self._workers.values()]

    @staticmethod
    def _load_of(worker: _Worker) -> wire.LoadReport | None:
        if worker.overloaded_until is None or time.monotonic() >= worker.overloaded_until:
            return worker.load
        return dataclasses.replace(worker.load or wire.LoadReport(), is_overloaded=True)

    @property
    def has_healthy(self) -> bool:
        return any(w.is_healthy for w in self._workers.values())

    @property
    def addresses(self) -> list[str]:
        return list(self._workers)

    def health_by_address(self) -> list[tuple[str, bool]]:
        """The rotation set as (address, is_healthy) pairs (retired workers, still finishing calls, are out)."""
        return [(w.address, w.is_healthy) for w in list(self._workers.values())]

    def is_healthy(self, address: str) -> bool:
        worker = self._workers.get(address)
        return worker is not None and worker.is_healthy

    def has_waiting(self, address: str) -> bool:
        """Whether the worker's last load report had requests waiting (queued or preempted): it is busy, and
        a request of it may go without tokens for a while."""
        worker = self._workers.get(address)
        return worker is not None and worker.load is not None and worker.load.num_waiting > 0

    async def admits(self, address: str) -> Admission:
        """A fresh probe of one worker (health, then load) within the probe timeout: whether it takes a new
        request now. A worker that says it is not serving, or that is silent while nothing shows it busy
        (frozen since its last periodic probe, when a few slow probes still keep it in rotation), is out of
        rotation until a periodic probe finds it serving again. One that is silent while busy (requests in
        flight on it: starved of CPU, not frozen) or whose load says overloaded is overloaded for now: the
        request goes elsewhere or comes back later, as for any overload."""
        worker = self._workers.get(address)
        if worker is None:
            return Admission.UNAVAILABLE
        timeout = self.config.probe_timeout_s
        try:
            health = await worker.health_stub.Check(health_pb2.HealthCheckRequest(service=self.service_name),
                                                    timeout=timeout)
            if health.status == health_pb2.HealthCheckResponse.SERVING:
                return await self._admits_by_load(worker)
            problem = f"health says {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                if self._heard_lately(worker):
                    return Admission.ADMITTED  # slow to answer, but streaming to this router: busy, not frozen
                if self._looks_busy(worker) and self._tolerates_slow_probe(worker, exc):
                    self.mark_overloaded(address, self.config.health_interval_s)
                    return Admission.OVERLOADED
            problem = f"admission probe failed: {exc.code().name}"
        self._note_problem(worker, problem, logging.WARNING)
        self.mark_unavailable(address)
        return Admission.UNAVAILABLE

    def note_heard(self, address: str) -> None:
        """A request call just got a message from the worker: it is alive, whatever its probes say."""
        worker = self._workers.get(address)
        if worker is not None:
            worker.last_heard = time.monotonic()

    def _heard_lately(self, worker: _Worker) -> bool:
        return time.monotonic() - worker.last_heard < self.config.probe_timeout_s

    @staticmethod
    def _looks_busy(worker: _Worker) -> bool:
        """Whether the worker has work that would keep it from answering a probe: this router's calls on it,
        or requests in flight in its last load report."""
        load = worker.load
        return worker.num_inflight > 0 or (load is not None and (load.num_running + load.num_waiting > 0
                                                                 or load.is_overloaded))

    async def _admits_by_load(self, worker: _Worker) -> Admission:
        """Whether a serving worker's fresh load report says it takes a new request. A busy pod may answer
        its load late: it is alive (it answered its health check), so only a report saying overloaded counts."""
        try:
            response = await worker.probe_stub.GetLoad(common_pb2.GetLoadRequest(), timeout=self.config.probe_timeout_s)
        except grpc.aio.AioRpcError:
            return Admission.ADMITTED
        worker.num_slow_probes = 0
        worker.load = load_report_from_proto(response.load)
        return Admission.OVERLOADED if worker.load.is_overloaded else Admission.ADMITTED

    def mark_unavailable(self, address: str) -> None:
        """A call failed with UNAVAILABLE: stop picking it until a probe says it is back."""
        worker = self._workers.get(address)
        if worker is not None:
            worker.is_healthy = False

    def mark_overloaded(self, address: str, for_s: float | None) -> None:
        """A call was refused as overloaded: count the worker as such for for_s seconds (the pod's
        retry hint), or until a probe says otherwise when it gave none."""
        worker = self._workers.get(address)
        if worker is None:
            return
        if for_s is None:
            worker.load = dataclasses.replace(worker.load or wire.LoadReport(), is_overloaded=True)
        else:
            worker.overloaded_until = time.monotonic() + for_s

    def retry_after_s(self) -> float:
        """When a worker of this tier that is overloaded now may take a call again: the soonest end of a
        refusal's retry hint, else the next health poll (it refreshes the load the pods report)."""
        now = time.monotonic()
        ends = [w.overloaded_until - now for w in self._workers.values()
                if w.overloaded_until is not None and w.overloaded_until > now]
        return min(ends, default=self.config.health_interval_s)

    @contextlib.contextmanager
    def use(self, address: str) -> Iterator[Any]:
        """The worker's client, counted as in flight for the duration."""
        worker = self._workers.get(address)
        if worker is None:
            raise LookupError(f"{self.tier} worker {address} is no longer known")
        worker.num_inflight += 1
        try:
            yield worker.client
        finally:
            worker.num_inflight -= 1
            if worker.is_retired and worker.num_inflight == 0:
                self._close_later(worker)
