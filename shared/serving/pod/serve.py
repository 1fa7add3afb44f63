"""Running a pod behind its gRPC server, as every pod's composition root ends: tracing, metrics endpoint,
health flipped to SERVING once the model and KV pool are ready, then the drain on SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
from typing import Callable, Mapping, Sequence

from shared.engine.kv_transfer.connector import KVRole
from shared.engine.kv_transfer.nixl_consumer import ConfirmRelease
from shared.engine.kv_transfer.nixl_loading import recommended_environment
from shared.serving.server.api_auth import BearerTokenInterceptor
from shared.serving.server.grpc_server import GrpcServer, ServerOptions, announce, serve_until_stopped
from shared.serving.server.http_server import HttpServer
from shared.serving.server.metrics import MetricsServer, ServiceMetrics, start_metrics_server
from shared.serving.pod.flags import PodServerConfig
from shared.serving.pod.runtime import Pod, PodConfig
from shared.serving.pod.servicer import PodServicer
from shared.serving.server.settings import config_from_args
from shared.serving.server.tls import TlsConfig
from shared.serving.server.telemetry import DEFAULT_UNTRACED_METHOD_PREFIXES, Tracing, TracingConfig, setup_tracing

logger = logging.getLogger(__name__)

# How often the pod's load gauges are refreshed for Prometheus.
GAUGE_INTERVAL_S = 0.5
# How often the pod checks that its engine thread is alive.
ENGINE_WATCH_INTERVAL_S = 0.5
# How often a draining pod looks whether its last requests and holds are gone.
DRAIN_POLL_S = 0.02
async def refresh_gauges(pod: Pod, metrics: ServiceMetrics) -> None:
    num_lease_expiries = num_queried = num_hit = num_steps = num_tokens = 0
    busy_s = 0.0
    while True:
        if pod.connector is not None:
            # The connector counts on the engine thread; the counter catches up here.
            metrics.lease_expiries.inc(pod.connector.num_lease_expiries - num_lease_expiries)
            num_lease_expiries = pod.connector.num_lease_expiries
            metrics.catch_up_kv_reads(pod.connector.num_reads, pod.connector.num_read_bytes)
        counters = pod.engine.counters  # engine-thread totals, caught up the same way
        queried, hit = counters.num_prefix_queried_tokens, counters.num_prefix_hit_tokens
        metrics.prefix_cache_queried_tokens.inc(queried - num_queried)
        metrics.prefix_cache_hit_tokens.inc(hit - num_hit)
        num_queried, num_hit = queried, hit
        metrics.engine_steps.inc(counters.num_compute_steps - num_steps)
        metrics.engine_tokens.inc(counters.num_scheduled_tokens - num_tokens)
        metrics.engine_busy_seconds.inc(counters.busy_s - busy_s)
        num_steps, num_tokens, busy_s = counters.num_compute_steps, counters.num_scheduled_tokens, counters.busy_s
        load = pod.load_report()
        metrics.set_queue(num_waiting=load.num_waiting, num_running=load.num_running)
        metrics.set_kv_blocks(
            num_used=load.num_total_blocks - load.num_free_blocks,
            num_free=load.num_free_blocks,
            num_held_for_peer=load.num_held_blocks,
        )
        await asyncio.sleep(GAUGE_INTERVAL_S)


async def drain(pod: Pod, grace_s: float) -> None:
    """Wait (at most grace_s) until no request is in flight and no KV is held for a peer."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        is_holding = pod.connector is not None and pod.connector.num_held_blocks > 0
        if pod.loop.num_in_flight == 0 and not is_holding:
            return
        await asyncio.sleep(DRAIN_POLL_S)
    logger.warning(
        "shutdown: %d request(s) still in flight after %.1fs, aborting them", pod.loop.num_in_flight, grace_s
    )


async def stop_when_the_engine_fails(pod: Pod, server: GrpcServer) -> None:
    """A crashed engine thread cannot serve: stop (health goes NOT_SERVING, requests in flight end with
    UNAVAILABLE) so the orchestrator replaces the pod instead of routing to it."""
    while pod.loop.error is None:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.error("the engine loop crashed (%r); stopping the pod", pod.loop.error)
    server.request_stop()


async def run_pod(
    role: KVRole | None,
    args: argparse.Namespace,
    pod_config: PodConfig,
    *,
    env: Mapping[str, str],
    service_name: str,
    services: Sequence[tuple[Callable, PodServicer, str]],
    http: HttpServer | None = None,
    api_token: str | None = None,
    confirm_release: ConfirmRelease | None = None,
) -> None:
    """Serve (health NOT_SERVING) while the pod loads, then SERVING until SIGTERM/SIGINT. Then:
    NOT_SERVING, refuse new work, let requests in flight finish (grace period), stop the pod.
    http: an HTTP front served beside the gRPC server (from the start; it answers 503 while loading).
    api_token: the bearer token the public API (a colocated pod's Generate) requires, if any.
    confirm_release: how a decode pod's connector confirms each pull's hold (Pod's)."""
    server_config = config_from_args(PodServerConfig, args)
    closers = contextlib.AsyncExitStack()
    tracing = start_tracing(server_config, env, service_name, closers)
    server = pod_grpc_server(server_config, pod_config.tls, tracing, services, api_token)
    set_kv_transport_env(server_config.kv_port_range, uses_cuda=pod_config.device.startswith("cuda"))
    if http is not None:
        server.drain_beside(http.stop)  # one drain: HTTP stops accepting and drains with the gRPC calls
        closers.push_async_callback(http.stop)

    async def start() -> list[str]:
        port = await server.start()
        if http is not None:
            await http.start(server.drain)
            announce(f"{service_name} OpenAI-compatible HTTP API at {http.url}/v1")
        pod = await load_pod(role, advertised(pod_config, role, server_config.host, port), server_config.kv_port_range,
                             tracing, confirm_release)
        server.on_shutdown(functools.partial(shut_down, pod, server, services))
        for _, servicer, _ in services:
            servicer.attach(pod)
        metrics = services[0][1].metrics  # the pod's metrics: its first service's
        metrics_server = start_metrics(server_config, metrics, closers)
        watch(pod, server, metrics, closers)
        await server.set_serving(True)
        lines = [f"{service_name} listening on {server.address} (engine {pod.engine_id})"]
        if metrics_server is not None:
            lines.append(f"{service_name} metrics at {metrics_server.url}")
        return lines

    await serve_until_stopped(server, start, closers)


def start_tracing(
    server_config: PodServerConfig, env: Mapping[str, str], service_name: str, closers: contextlib.AsyncExitStack
) -> Tracing:
    tracing = setup_tracing(
        TracingConfig.from_flags_and_env(
            env,
            default_service_name=f"pdserve-{service_name}",
            otlp_endpoint=server_config.otlp_endpoint,
            sampling_ratio=server_config.otel_sampling_ratio,
        )
    )
    closers.callback(tracing.shutdown)
    return tracing


def pod_grpc_server(
    server_config: PodServerConfig, tls: TlsConfig, tracing: Tracing,
    services: Sequence[tuple[Callable, PodServicer, str]], api_token: str | None,
) -> GrpcServer:
    """The pod's gRPC server with its services registered; they trace with the pod's tracing."""
    # Load polls come every second from every router: tracing them would bury the request traces.
    untraced = (*DEFAULT_UNTRACED_METHOD_PREFIXES, *(f"/{name}/GetLoad" for _, _, name in services))
    interceptors = list(tracing.server_interceptors(untraced))
    if api_token is not None:
        interceptors.append(BearerTokenInterceptor(api_token))
    server = GrpcServer(
        ServerOptions(host=server_config.host, port=server_config.port, grace_seconds=server_config.grace_seconds,
                      tls=tls),
        interceptors=interceptors,
    )
    for add_to_server, servicer, name in services:
        servicer.use_tracing(tracing)
        server.add_service(add_to_server, servicer, name)
    return server


def set_kv_transport_env(kv_port_range: str, *, uses_cuda: bool) -> None:
    """UCX reads these when the NIXL agent starts, inside Pod(). Non-blocking connects: with UCX's default
    blocking connect, a peer whose KV ports drop packets stalls the engine thread for the kernel's whole
    SYN retry time (about two minutes) instead of failing the pull at its deadline. A pod started as
    `python -m prefill_svc` (the launcher, k8s) skips the CLI's set-up, and on a GPU without NVLink UCX
    then routes device-memory READs over TCP; an operator's own value wins."""
    os.environ["UCX_TCP_PORT_RANGE"] = kv_port_range
    os.environ.setdefault("UCX_TCP_CONN_NB", "y")
    for name, value in recommended_environment(uses_cuda=uses_cuda).items():
        os.environ.setdefault(name, value)


_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def advertised(pod_config: PodConfig, role: KVRole | None, host: str, port: int) -> PodConfig:
    """A prefill pod without --advertise-address advertises the address its server is bound to, or, bound to
    every address, this host's address on its default route (a decode pod dialing 0.0.0.0 reaches itself)."""
    if role is not KVRole.PRODUCER or pod_config.advertise_address:
        return pod_config
    if host in _WILDCARD_HOSTS:
        host = _default_route_address()
        logger.info("bound to every address: advertising %s:%s to decode pods (--advertise-address sets it)",
                    host, port)
    return dataclasses.replace(pod_config, advertise_address=f"{host}:{port}")


def _default_route_address() -> str:
    """The address this host sends from by default. A UDP connect only picks the route: nothing is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): any routable address would do
            return probe.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"the pod is bound to every address and this host has no default route to tell which one "
                         f"decode pods reach it at ({exc}): pass --advertise-address HOST:PORT") from None


async def load_pod(role: KVRole | None, pod_config: PodConfig, kv_port_range: str, tracing: Tracing,
                   confirm_release: ConfirmRelease | None = None) -> Pod:
    """Loads the model and the KV pool off the event loop (the server keeps answering health), then
    starts the engine thread."""
    logger.info("torch threads: %s; KV transfer ports: %s", pod_config.num_threads or "torch's default",
                kv_port_range)
    pod = await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(Pod, role, pod_config, confirm_release=confirm_release))
    pod.loop.is_timing_requests = tracing.is_enabled  # the timelines only feed trace spans
    pod.start()
    return pod


async def shut_down(pod: Pod, server: GrpcServer, services: Sequence[tuple[Callable, PodServicer, str]]) -> None:
    """The server's on_shutdown (readiness already NOT_SERVING): refuse new work, let requests in flight
    finish within what is left of the grace period, stop the pod, then the servicers."""
    for _, servicer, _ in services:
        servicer.is_draining = True
    await drain(pod, server.shutdown_seconds_left())
    await pod.stop()
    for _, servicer, _ in services:
        await servicer.close()


def start_metrics(
    server_config: PodServerConfig, metrics: ServiceMetrics, closers: contextlib.AsyncExitStack
) -> MetricsServer | None:
    """The Prometheus endpoint, when --metrics-port is set."""
    if server_config.metrics_port is None:
        return None
    metrics_server = start_metrics_server(metrics.registry, server_config.host, server_config.metrics_port)
    closers.callback(metrics_server.stop)
    return metrics_server


def watch(pod: Pod, server: GrpcServer, metrics: ServiceMetrics, closers: contextlib.AsyncExitStack) -> None:
    """The pod's background tasks: its load gauges, and the engine thread's watcher."""
    for task in (refresh_gauges(pod, metrics), stop_when_the_engine_fails(pod, server)):
        closers.callback(asyncio.ensure_future(task).cancel)
