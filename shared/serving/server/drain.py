"""One drain for a process's fronts, gRPC and HTTP: the calls in flight are counted (the drain's start and
end are logged with them), and those still running just before the drain's deadline are ended with an
error the client can read (a gRPC UNAVAILABLE status; an SSE error event, or a 503) instead of being cut."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

logger = logging.getLogger(__name__)

# Calls still running this long before the deadline are ended, so their error reaches the client in time.
END_MARGIN_S = 1.0
SHUTDOWN_MESSAGE = "the server is shutting down and this call could not finish within its drain period"
# Health and reflection calls are the probes' and tools', not work: not counted, never ended early.
UNCOUNTED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass
class _Call:
    front: str
    task: asyncio.Task | None
    is_ended_by_drain: bool = False


@dataclass
class Drain:
    """The calls in flight on every front of one process, and how the drain ended them."""

    _live: dict[int, _Call] = field(default_factory=dict)
    _started_at: float | None = None
    _num_at_start: dict[str, int] = field(default_factory=dict)
    _num_ended: dict[str, int] = field(default_factory=lambda: {"grpc": 0, "http": 0})

    @contextlib.contextmanager
    def track(self, front: str) -> Iterator[_Call]:
        call = _Call(front, asyncio.current_task())
        self._live[id(call)] = call
        try:
            yield call
        finally:
            del self._live[id(call)]
            if call.is_ended_by_drain:
                self._num_ended[front] += 1

    def num_in_flight(self, front: str) -> int:
        return sum(1 for call in self._live.values() if call.front == front)

    @contextlib.asynccontextmanager
    async def draining(self, grace_s: float, deadline: float):
        """The drain: logs its start, ends what still runs just before deadline, logs its end."""
        self.begin(grace_s)
        ending = asyncio.ensure_future(self.end_the_rest_at(deadline))
        try:
            yield
        finally:
            ending.cancel()
            self.finish()

    def begin(self, grace_s: float) -> None:
        self._started_at = time.monotonic()
        self._num_at_start = {front: self.num_in_flight(front) for front in ("grpc", "http")}
        logger.info("drain started: %d gRPC call(s) and %d HTTP request(s) in flight; they have %.0f s to finish",
                    self._num_at_start["grpc"], self._num_at_start["http"], grace_s)

    async def end_the_rest_at(self, deadline: float) -> None:
        """Sleeps until END_MARGIN_S before deadline, then ends every call still in flight with an error."""
        await asyncio.sleep(max(0.0, deadline - END_MARGIN_S - time.monotonic()))
        for call in list(self._live.values()):
            if call.task is not None and not call.task.done():
                call.is_ended_by_drain = True
                call.task.cancel()

    def finish(self) -> None:
        if self._started_at is None:
            return
        started = sum(self._num_at_start.values())
        ended = sum(self._num_ended.values())
        logger.info("drain finished in %.1f s: of %d call(s) in flight at its start (%d gRPC, %d HTTP), %d "
                    "finished and %d were ended with an error at its deadline (%d gRPC, %d HTTP)",
                    time.monotonic() - self._started_at, started, self._num_at_start["grpc"],
                    self._num_at_start["http"], max(0, started - ended), ended, self._num_ended["grpc"],
                    self._num_ended["http"])
        self._started_at = None


# ---- gRPC ---------------------------------------------------------------------------------------
class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Counts each call while it runs; a call the drain ends gets UNAVAILABLE with SHUTDOWN_MESSAGE."""

    def __init__(self, drain: Drain):
        self._drain = drain

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNCOUNTED_SERVICES):
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: self._wrap(behavior)})
        return handler

    def _wrap(self, behavior):
        drain = self._drain
        if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
            return behavior  # a sync handler: grpc runs it in a thread, out of the drain's reach
        if inspect.isasyncgenfunction(behavior):
            async def streamed(request, context):
                with drain.track("grpc") as call:
                    try:
                        async for item in behavior(request, context):
                            yield item
                    except asyncio.CancelledError:
                        if not call.is_ended_by_drain:
                            raise
                        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
            return streamed

        async def whole(request, context):
            with drain.track("grpc") as call:
                try:
                    return await behavior(request, context)
                except asyncio.CancelledError:
                    if not call.is_ended_by_drain:
                        raise
                    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        return whole


# ---- HTTP ---------------------------------------------------------------------------------------
def _error_body() -> bytes:
    return json.dumps({"error": {"message": SHUTDOWN_MESSAGE, "type": "server_shutting_down", "param": None,
                                 "code": 503}}).encode()


class DrainMiddleware:
    """ASGI: counts each HTTP request while it runs. One the drain ends gets, if its answer has not started,
    a 503 with an OpenAI-style error body; if it is an event stream, a last `data: {"error": ...}` event and
    `data: [DONE]` (the answer's events so far are whole: each chunk the app sends is whole events)."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self._drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        answer = {"started": False, "is_events": False, "ended": False}

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                answer["started"] = True
                headers = dict(message.get("headers", []))
                answer["is_events"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answer["ended"] = True
            await send(message)

        with self._drain.track("http") as call:
            try:
                await self.app(scope, receive, tracked_send)
            except asyncio.CancelledError:
                if not call.is_ended_by_drain or answer["ended"]:
                    raise
                await self._end(send, answer)

    @staticmethod
    async def _end(send, answer: dict) -> None:
        if not answer["started"]:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": _error_body()})
        elif answer["is_events"]:
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + _error_body() + b"\n\ndata: [DONE]\n\n"})
