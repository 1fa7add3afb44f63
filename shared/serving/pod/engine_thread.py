"""Runs one LLMEngine on a dedicated thread and bridges it to asyncio servicers.

The engine is single-threaded by design: every engine and connector call happens on the loop thread.
Servicers submit requests and read per-request output streams; results cross threads in batches.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from shared.engine.request import DuplicateRequestError, RequestStatus
from shared.serving.pod.outcomes import DuplicateRequestId, InvalidRequest, PodUnavailable
from shared.serving.queue_time import WaitPredictor

logger = logging.getLogger(__name__)

# How long the loop thread naps between steps that scheduled nothing while it still has to poll
# (KV held for a peer, pulls in flight). Short enough to keep NIXL progressing, long enough to
# leave the other core to the pods' gRPC threads.
DEFAULT_POLL_INTERVAL_S = 0.0005
# Longest nap when there is nothing at all to do; new work wakes the thread at once anyway.
IDLE_WAIT_S = 0.05


class EngineStopped(PodUnavailable):
    """The engine loop stopped (shutdown or crash) before the request finished."""


@dataclass
class RequestTimeline:
    """When one request passed each stage in the engine, as time.time_ns() values (trace spans are
    built from them). Written on the engine thread before the output that follows each stage is
    handed over, so a reader that has seen that output sees the value; None: not reached (yet)."""

    submitted_ns: int
    scheduled_ns: int | None = None  # first step that took it from the queue (pull posted or computing)
    kv_wait_started_ns: int | None = None  # first step that left it waiting for remote KV
    computing_ns: int | None = None  # first step that computed its tokens (after any pull)
    finished_ns: int | None = None  # end of the step that produced its finished output


class RequestStream:
    """The outputs of one request, in order, as an async iterator ending after the finished output."""

    def __init__(self, request_id: str, timeline: RequestTimeline | None = None):
        self.request_id = request_id
        self.timeline = timeline if timeline is not None else RequestTimeline(time.time_ns())
        # The engine refused the request: it never entered, so nothing may be aborted under its id
        # (that would hit another request with the same id).
        self.refused = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self):
        item = self._check(await self._queue.get())
        if item is None:
            raise StopAsyncIteration
        return item

    async def batches(self):
        """Yield lists of every output ready at once (so a slow reader gets fewer, fuller messages)."""
        while True:
            batch = [self._check(await self._queue.get())]
            while batch[-1] is not None and not self._queue.empty():
                batch.append(self._check(self._queue.get_nowait()))
            if batch[-1] is None:
                batch.pop()
                if batch:
                    yield batch
                return
            yield batch

    @staticmethod
    def _check(item: Any) -> Any:
        if isinstance(item, BaseException):
            raise item
        return item


class EngineLoop:
    """Owns the engine thread. Create and use from one asyncio event loop."""

    def __init__(self, engine, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S):
        self.engine = engine
        self._poll_interval_s = poll_interval_s
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        # Stamp each request's timeline (trace spans need it); off by default: no per-request work then.
        self.is_timing_requests = False
        # Engine thread only: requests not yet computing, and the timeline of every request in flight.
        self._unstarted: dict[str, tuple[Any, RequestTimeline]] = {}
        self._timelines: dict[str, RequestTimeline] = {}
        self._stopping = False
        # Fed by every step that computed something; the pod predicts queueing waits from it.
        self.wait_predictor = WaitPredictor()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    # ---- asyncio side ---------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, request) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream."""
        if self._stopping or self.error is not None:
            raise EngineStopped("the engine is shutting down")
        if request.request_id in self._streams:
            raise DuplicateRequestId(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(request.request_id)
        self._streams[request.request_id] = stream
        self._send(lambda: self._add(request, stream.timeline))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed by the engine. The engine is told even when the
        request's last output already left it: a request finished by the step that was running
        when the caller gave up may hold blocks for a peer that will never come."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(None)
        self._send(lambda: self._abort(request_id))

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread, between steps; resolves with its result (the KV event
        feed takes its snapshots this way, so no step runs in the middle of one)."""
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller, not swallowed
                self._loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self._loop.call_soon_threadsafe(_set_result, future, result)

        self._send(run)
        return future

    def wake(self) -> None:
        """Make the loop thread look for work now (e.g. a connector event arrived from another thread)."""
        self._wakeup.set()

    async def stop(self) -> None:
        """Abort everything in flight, stop the thread and wait for it."""
        if self._stopping:
            return
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wakeup.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _deliver(self, outputs: list) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its caller meanwhile
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]
                stream._put(None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._put(EngineStopped(f"engine loop crashed: {error!r}"))
        self._streams.clear()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                if self._has_work():
                    self._step()
                else:
                    self._wakeup.wait(IDLE_WAIT_S)
                    self._wakeup.clear()
                    self.engine.progress_kv_while_idle()
            self._run_commands()  # aborts queued by stop()
            self._drain_aborted()
        except BaseException as exc:  # the pod must report it, not hang its clients
            logger.exception("engine loop crashed")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _add(self, request, timeline: RequestTimeline) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # refused: tell that request, keep serving the rest
            self._loop.call_soon_threadsafe(self._refuse, request.request_id, _refusal(request.request_id, exc))
            return
        if not self.is_timing_requests:
            return
        self._unstarted[request.request_id] = (request, timeline)
        self._timelines[request.request_id] = timeline

    def _abort(self, request_id: str) -> None:
        self._unstarted.pop(request_id, None)
        self._timelines.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _refuse(self, request_id: str, error: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.refused = True
            stream._put(error)

    def _run_commands(self) -> None:
        while self._commands:
            self._commands.popleft()()

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.has_pending_kv_work()

    def _step(self) -> None:
        started_ns = time.time_ns()
        outputs = self.engine.step()
        if outputs:
            num_finished = sum(1 for output in outputs if output.finished)
            self.wait_predictor.observe_step((time.time_ns() - started_ns) / 1e9, num_finished)
        self._observe(started_ns, outputs)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        elif not self._commands:
            # Nothing computed this step (waiting on remote KV or a peer's pull): nap briefly
            # instead of spinning a core, but wake at once for new work.
            self._wakeup.wait(self._poll_interval_s)
            self._wakeup.clear()

    def _observe(self, step_started_ns: int, outputs: list) -> None:
        """Stamp the timelines from what this step did: the scheduler moved each request's status."""
        for request_id, (request, timeline) in list(self._unstarted.items()):
            status = request.status
            if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if timeline.kv_wait_started_ns is None:
                    timeline.kv_wait_started_ns = step_started_ns
                    timeline.scheduled_ns = timeline.scheduled_ns or step_started_ns
            elif status != RequestStatus.WAITING or request.num_computed_tokens > 0:
                # Running (or already finished/aborted): the step that started it began at step_started_ns.
                timeline.scheduled_ns = timeline.scheduled_ns or step_started_ns
                timeline.computing_ns = step_started_ns
                del self._unstarted[request_id]
        if not outputs or not self._timelines:
            return
        now_ns = time.time_ns()
        for output in outputs:
            if output.finished:
                timeline = self._timelines.pop(output.request_id, None)
                self._unstarted.pop(output.request_id, None)
                if timeline is not None:
                    timeline.finished_ns = now_ns

    def _drain_aborted(self) -> None:
        """Let the engine free the blocks of requests aborted at shutdown (bounded)."""
        for _ in range(1000):
            if not self._has_work():
                return
            self.engine.step()


def _refusal(request_id: str, exc: Exception) -> Exception:
    """What the caller of a request the engine would not add is told."""
    if isinstance(exc, DuplicateRequestError):
        return DuplicateRequestId(str(exc))
    if isinstance(exc, ValueError):
        return InvalidRequest(str(exc))
    if isinstance(exc, RecursionError):  # input nested past the interpreter's limit
        return InvalidRequest(f"request {request_id!r} nests too deeply to process")
    logger.error("adding request %r failed", request_id, exc_info=exc)
    return exc  # the call ends with INTERNAL; the pod keeps serving


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
