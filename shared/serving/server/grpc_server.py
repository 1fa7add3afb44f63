"""One place for running a pdserve gRPC service: grpc.aio server with message-size limits, standard health
(readiness: the overall status "", NOT_SERVING until the owner says ready; liveness: the "liveness" service,
SERVING while the process works), reflection, interceptors, malformed-message -> INVALID_ARGUMENT and
unexpected-exception -> INTERNAL mapping, optional TLS, graceful shutdown on SIGTERM/SIGINT within one
deadline, and the start / announce / wait / stop sequence every composition root ends with
(serve_until_stopped).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.serving.server.drain import Drain, DrainInterceptor
from shared.serving.server.tls import TlsConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How the services' channels to each other connect. A restarted pod is back within seconds: reconnect at
# most a second after it is. They ping the other end every few seconds, idle or not: a connection that died
# without a word (a network partition drops packets, it sends no reset) is noticed and replaced within
# seconds of the path healing, instead of after TCP's own retry timer (minutes).
KEEPALIVE_TIME_MS = 5_000
SERVICE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    # Generous: a pod starved of CPU by a burst answers late, and a missed answer drops every call on the
    # connection. A partition still shows within seconds, long before TCP's own timers.
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's bound on one connection attempt (20 s by default): one begun while the path was down gives
    # up, and the next is made, within seconds of its healing.
    ("grpc.min_reconnect_backoff_ms", 2_000),
]
# The health service name a liveness probe asks for: SERVING from start() until the server stops, whatever
# the readiness says, so an orchestrator never restarts a process that merely waits for its peers or model.
LIVENESS_SERVICE = "liveness"


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens. port 0 picks a free port (read it from GrpcServer.port after start)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 5.0
    max_concurrent_rpcs: int | None = None
    tls: TlsConfig = TlsConfig()  # plain text unless it holds a certificate

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host is empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")

    @property
    def grpc_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # Two servers must never share a port silently (a stale pod would steal traffic).
            ("grpc.so_reuseport", 0),
            # Accept the services' keepalive pings (SERVICE_CHANNEL_OPTIONS); a server that refused them
            # would answer GOAWAY and make the clients ping ever less often.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.http2.max_ping_strikes", 0),
        ]


# ---- malformed request bytes -> INVALID_ARGUMENT ----------------------------------------------
# grpc aio answers a request deserializer that raises with UNKNOWN and a traceback in the log. So the
# deserializer returns a marker instead, and the handler wrapper turns it into INVALID_ARGUMENT.


@dataclass(frozen=True)
class _Malformed:
    """Stands for request bytes that did not parse."""

    num_bytes: int
    error: str


class _MalformedRequest(Exception):
    """A streamed request message did not parse (raised from the wrapped request iterator)."""

    def __init__(self, malformed: _Malformed):
        super().__init__(malformed.error)
        self.malformed = malformed


def _tolerant_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure means the caller sent bad bytes
            return _Malformed(len(data), str(exc) or type(exc).__name__)

    return parse


async def _checked_iterator(request_iterator):
    async for message in request_iterator:
        if isinstance(message, _Malformed):
            raise _MalformedRequest(message)
        yield message


def _checked_request(request_or_iterator):
    """The request itself (raising _MalformedRequest if it did not parse), or a checking iterator."""
    if isinstance(request_or_iterator, _Malformed):
        raise _MalformedRequest(request_or_iterator)
    if hasattr(request_or_iterator, "__aiter__"):
        return _checked_iterator(request_or_iterator)
    return request_or_iterator


async def _abort_malformed(context: grpc.aio.ServicerContext, method: str, malformed: _Malformed) -> None:
    logger.warning("malformed request to %s (%d bytes): %s", method, malformed.num_bytes, malformed.error)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed request message for {method}: the bytes do not parse ({malformed.error})",
    )


# ---- unexpected exceptions -> INTERNAL --------------------------------------------------------

_PASS_THROUGH = (asyncio.CancelledError, grpc.aio.AbortError)


async def _abort_internal(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if context.done():
        # The call already ended (its deadline passed, or the client left): nobody to answer, and grpc
        # refuses an abort now. Typically the handler's own abort, racing that end, is what raised.
        logger.info("%s raised %s after the call had ended: %s", method, type(exc).__name__, exc)
        return
    logger.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def _wrap_unary_response(behavior: Callable, method: str) -> Callable:
    async def wrapper(request_or_iterator, context):
        try:
            return await behavior(_checked_request(request_or_iterator), context)
        except _PASS_THROUGH:
            raise
        except _MalformedRequest as exc:
            await _abort_malformed(context, method, exc.malformed)
        except Exception as exc:  # noqa: BLE001 - this is the one place unexpected errors are mapped
            await _abort_internal(context, method, exc)

    return wrapper


def _wrap_stream_response(behavior: Callable, method: str) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def generator_wrapper(request_or_iterator, context):
            try:
                async for response in behavior(_checked_request(request_or_iterator), context):
                    yield response
            except _PASS_THROUGH:
                raise
            except _MalformedRequest as exc:
                await _abort_malformed(context, method, exc.malformed)
            except Exception as exc:  # noqa: BLE001
                await _abort_internal(context, method, exc)

        return generator_wrapper
    # A coroutine that writes with context.write(); a sync iterator is left to grpc.
    if inspect.iscoroutinefunction(behavior):
        return _wrap_unary_response(behavior, method)
    return behavior


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request bytes do not parse with INVALID_ARGUMENT (one log line), and one whose
    handler lets an exception escape with INTERNAL (logged with its traceback), instead of UNKNOWN."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        for kind, wrap, make_handler in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is None:
                continue
            wrapped = wrap(behavior, method)
            if wrapped is behavior:
                return handler  # not ours to wrap (a sync iterator): grpc's own handling stays
            return make_handler(
                wrapped,
                request_deserializer=_tolerant_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


_HANDLER_KINDS = (
    ("unary_unary", _wrap_unary_response, grpc.unary_unary_rpc_method_handler),
    ("stream_unary", _wrap_unary_response, grpc.stream_unary_rpc_method_handler),
    ("unary_stream", _wrap_stream_response, grpc.unary_stream_rpc_method_handler),
    ("stream_stream", _wrap_stream_response, grpc.stream_stream_rpc_method_handler),
)


# ---- the server -------------------------------------------------------------------------------


class GrpcServer:
    """Owns one grpc.aio server. Register services and interceptors, then start(); the owner calls
    set_serving(True) when its model and KV pool are ready.

    `interceptors` is the hook list: append to it before start() (e.g. telemetry); the error-mapping
    interceptor always runs innermost, closest to the handler.
    """

    def __init__(self, options: ServerOptions, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.options = options
        self.interceptors: list[grpc.aio.ServerInterceptor] = list(interceptors)
        self._registrations: list[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]] = []
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._shutdown_deadline: float | None = None
        self._on_shutdown: list[Callable[[], Any]] = []
        self._drained_beside: list[Callable[[float], Awaitable[None]]] = []
        self.drain = Drain()  # the calls in flight on this process's fronts (an HTTP front shares it)

    def add_service(
        self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any, service_name: str
    ) -> None:
        """Registers a servicer, e.g. (generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer,
        "pdserve.v1.GenerateService"); the name is used for health and reflection."""
        if self._server is not None:
            raise RuntimeError("add_service must be called before start()")
        self._registrations.append((add_to_server, servicer, service_name))

    def on_shutdown(self, callback: Callable[[], Any]) -> None:
        """Runs (awaited if a coroutine) after health flips to NOT_SERVING and before the server stops."""
        self._on_shutdown.append(callback)

    def drain_beside(self, stop: Callable[[float], Awaitable[None]]) -> None:
        """Another front (HTTP) that drains together with this one: stop(grace seconds) is started as the
        drain begins (it stops accepting and waits for its calls in flight) and awaited with the RPCs."""
        self._drained_beside.append(stop)

    @property
    def service_names(self) -> list[str]:
        return [name for _, _, name in self._registrations]

    @property
    def is_started(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> int:
        """Binds and starts serving RPCs (health reports NOT_SERVING); returns the bound port."""
        if self._server is not None:
            raise RuntimeError("server already started")
        server = grpc.aio.server(
            interceptors=[DrainInterceptor(self.drain), *self.interceptors, ErrorMappingInterceptor()],
            options=self.options.grpc_options,
            maximum_concurrent_rpcs=self.options.max_concurrent_rpcs,
        )
        for add_to_server, servicer, _ in self._registrations:
            add_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        credentials = self.options.tls.server_credentials()
        target = f"{self.options.host}:{self.options.port}"
        try:
            if credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot bind {self.options.host}:{self.options.port}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot bind {self.options.host}:{self.options.port}")
        await self.set_serving(False)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server, self._port = server, port
        logger.info(
            "gRPC server listening on %s:%d (%s; %s)", self.options.host, port, ", ".join(self.service_names),
            ("mTLS" if self.options.tls.tls_ca else "TLS") if credentials is not None else "plain text",
        )
        return port

    async def set_serving(self, is_serving: bool) -> None:
        """Flips readiness: the overall and per-service health status (ignored once shutdown began)."""
        if self._stopped:
            return
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self._health.set(name, status)

    def shutdown_seconds_left(self) -> float:
        """Time left of the grace period once shutdown began (the whole grace period before)."""
        if self._shutdown_deadline is None:
            return self.options.grace_seconds
        return max(0.0, self._shutdown_deadline - time.monotonic())

    def request_stop(self) -> None:
        """Asks serve_forever() to shut down gracefully (safe from a signal handler)."""
        self._stop_requested.set()

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Graceful shutdown within one deadline: readiness NOT_SERVING first (so balancers drain), owner
        callbacks (which may wait, see shutdown_seconds_left()), then in-flight RPCs, and whatever drains
        beside them (drain_beside: the HTTP front), get what is left, together. Calls still running just
        before the deadline end with an error (shared/serving/server/drain.py). Liveness stays SERVING until the
        server stops: a draining process still works."""
        if self._stopped or self._server is None:
            return
        grace = self.options.grace_seconds if grace_seconds is None else grace_seconds
        self._shutdown_deadline = time.monotonic() + grace
        await self.set_serving(False)
        self._stopped = True
        async with self.drain.draining(grace, self._shutdown_deadline):
            # The other fronts stop accepting now and drain their calls in flight while the callbacks run.
            beside = [asyncio.ensure_future(stop(grace)) for stop in self._drained_beside]
            for callback in self._on_shutdown:
                try:
                    result = callback()
                    if inspect.isawaitable(result):
                        await result
                except Exception:  # noqa: BLE001 - shutdown must go on
                    logger.exception("shutdown callback failed")
            await asyncio.gather(self._server.stop(self.shutdown_seconds_left()), *beside)
        await self._health.enter_graceful_shutdown()
        self._stop_requested.set()

    async def serve_forever(self, *, handle_signals: bool = True) -> None:
        """Waits until SIGTERM/SIGINT (or request_stop()), then stops gracefully."""
        if not self.is_started:
            await self.start()
        if handle_signals:
            self.install_signal_handlers()
        await self._stop_requested.wait()
        await self.stop()


# The end of every composition root, kept importable from here.
from shared.serving.server.serve_loop import announce, serve_until_stopped  # noqa: E402,F401
