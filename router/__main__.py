"""Composition root of the router: flags -> config -> worker pools, servicer, gRPC server; runs until
SIGTERM/SIGINT. Start with `python -m router --prefill HOST:PORT --decode HOST:PORT`."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry

from proto.pdserve.v1 import decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc
from router.flags import RouterConfig, build_arg_parser
from router.kv_index import KvIndex
from router.kv_subscriptions import KvEventSubscriptions
from router.metrics import RouterMetrics
from router.servicer import RouterServicer
from shared.serving.text import TextCodec
from router.workers import WorkerPool
from shared.serving.server.api_auth import BearerTokenInterceptor, log_token_requirement
from shared.serving.server.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES, SERVICE_CHANNEL_OPTIONS, GrpcServer, ServerOptions, serve_until_stopped,
)
from shared.serving.server.http_server import HttpServer
from shared.serving.openai.app import HttpFront
from shared.serving.server.metrics import MetricsServer, start_metrics_server
from shared.serving.prefill_client import PrefillClient
from shared.serving.server.telemetry import Tracing, TracingConfig, setup_tracing

logger = logging.getLogger("router")

GENERATE_SERVICE = "pdserve.v1.GenerateService"
PREFILL_SERVICE = "pdserve.v1.PrefillService"
DECODE_SERVICE = "pdserve.v1.DecodeService"


# How the router's channels to the pods are set up (worker pools and KV event streams alike).
POD_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    *SERVICE_CHANNEL_OPTIONS,
]


async def run(
    config: RouterConfig, *, env: dict[str, str], codec: TextCodec | None = None, api_token: str | None = None
) -> None:
    """Serves until SIGTERM/SIGINT. api_token: the bearer token Generate callers must send, if any."""
    closers = contextlib.AsyncExitStack()
    tracing = start_tracing(config, env, closers)
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    metrics_server = start_metrics(config, registry, closers)
    server = GrpcServer(
        ServerOptions(host=config.host, port=config.port, grace_seconds=config.grace_seconds, tls=config.tls),
        interceptors=public_interceptors(tracing, api_token),
    )

    async def update_health() -> None:
        # Readiness: the router can serve only when both tiers have at least one healthy worker. Liveness
        # (GrpcServer's "liveness" service) does not follow the tiers: a router waiting for them still works.
        if server.is_started:
            await server.set_serving(prefill.has_healthy and decode.has_healthy)
        if subscriptions is not None:
            subscriptions.sync([*prefill.addresses, *decode.addresses])

    subscriptions, kv_index = follow_kv_events(config, closers)
    prefill, decode = worker_pools(config, tracing, update_health, closers)
    metrics.watch_workers({pool.tier: pool.health_by_address for pool in (prefill, decode)})
    servicer = RouterServicer(prefill, decode, config, codec=codec, metrics=metrics,
                              tracer=tracing.tracer, kv_index=kv_index)
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, GENERATE_SERVICE)
    http = http_front(config, servicer, codec, registry, api_token, tracing,
                      is_ready=lambda: prefill.has_healthy and decode.has_healthy)
    if http is not None:
        server.drain_beside(http.stop)  # one drain: HTTP stops accepting and drains with the gRPC calls
        closers.push_async_callback(http.stop)
    server.on_shutdown(servicer.drain)

    async def start() -> list[str]:
        await server.start()
        if http is not None:
            await http.start(server.drain)
        await prefill.start()
        await decode.start()
        await update_health()
        return announcements(server, prefill, decode, config, metrics_server, http)

    await serve_until_stopped(server, start, closers)


def start_tracing(config: RouterConfig, env: dict[str, str], closers: contextlib.AsyncExitStack) -> Tracing:
    tracing = setup_tracing(
        TracingConfig.from_flags_and_env(env, default_service_name="pdserve-router", otlp_endpoint=config.otlp_endpoint)
    )
    closers.callback(tracing.shutdown)
    return tracing


def start_metrics(
    config: RouterConfig, registry: CollectorRegistry, closers: contextlib.AsyncExitStack
) -> MetricsServer | None:
    """The Prometheus endpoint, when --metrics-port is set."""
    if config.metrics_port is None:
        return None
    metrics_server = start_metrics_server(registry, config.host, config.metrics_port)
    closers.callback(metrics_server.stop)
    return metrics_server


def public_interceptors(tracing: Tracing, api_token: str | None) -> list:
    interceptors = list(tracing.server_interceptors())
    if api_token is not None:
        interceptors.append(BearerTokenInterceptor(api_token))
    return interceptors


def follow_kv_events(
    config: RouterConfig, closers: contextlib.AsyncExitStack
) -> tuple[KvEventSubscriptions | None, KvIndex | None]:
    """The KV index and its event streams, when the policy needs them. Each router replica follows every
    pod's KV events itself: same events, same index."""
    if not config.needs_kv_index:
        return None, None
    kv_index = KvIndex(config.kv_index_max_blocks)
    subscriptions = KvEventSubscriptions(kv_index, POD_CHANNEL_OPTIONS, tls=config.tls)
    closers.push_async_callback(subscriptions.close)
    return subscriptions, kv_index


def worker_pools(
    config: RouterConfig, tracing: Tracing, on_poll: Callable[[], Awaitable[None]],
    closers: contextlib.AsyncExitStack,
) -> tuple[WorkerPool, WorkerPool]:
    """The prefill and the decode tier; on_poll runs after each health poll."""
    wiring = dict(channel_options=POD_CHANNEL_OPTIONS, interceptors=tracing.client_interceptors(),
                  on_poll=on_poll, tls=config.tls)
    prefill = WorkerPool(
        "prefill", config.prefill, prefill_pb2_grpc.PrefillServiceStub, PREFILL_SERVICE, config.pool,
        client_class=lambda channel: PrefillClient(channel, config.prefill_client), **wiring,
    )
    decode = WorkerPool(
        "decode", config.decode, decode_pb2_grpc.DecodeServiceStub, DECODE_SERVICE, config.pool, **wiring
    )
    closers.push_async_callback(prefill.close)
    closers.push_async_callback(decode.close)
    return prefill, decode


def http_front(
    config: RouterConfig, servicer: RouterServicer, codec: TextCodec | None, registry: CollectorRegistry,
    api_token: str | None, tracing: Tracing, *, is_ready: Callable[[], bool],
) -> HttpServer | None:
    """The OpenAI-compatible HTTP API, when --http-port is set (is_ready: its readiness, as the gRPC one);
    HTTPS, and mTLS, with the gRPC server's TLS settings."""
    if config.http.http_port is None:
        return None
    front = HttpFront(
        servicer.generate, model_name=served_model_name(config), codec=lambda: codec,
        registry=registry, is_ready=is_ready,
        max_model_len=lambda: servicer.max_model_len, api_key=api_token, tracer=lambda: tracing.tracer,
        config=config.http, model_aliases=(config.tokenizer_path,) if config.tokenizer_path else (),
    )
    return HttpServer(front.app, config.host, config.http.http_port, config.tls)


def announcements(
    server: GrpcServer, prefill: WorkerPool, decode: WorkerPool, config: RouterConfig,
    metrics_server: MetricsServer | None, http: HttpServer | None,
) -> list[str]:
    """What the router serves where; the first line is the one tests read the address from."""
    lines = [f"router listening on {server.address} (prefill: {', '.join(prefill.addresses)}; "
             f"decode: {', '.join(decode.addresses)}; policy {config.policy})"]
    if metrics_server is not None:
        lines.append(f"router metrics at {metrics_server.url}")
    if http is not None:
        lines.append(f"router OpenAI-compatible HTTP API at {http.url}/v1")
    return lines


def served_model_name(config: RouterConfig) -> str:
    """The name HTTP clients put in "model": the flag's, else the tokenizer's (a preset or directory name)."""
    if config.http.served_model_name:
        return config.http.served_model_name
    if config.tokenizer_path:
        return os.path.basename(os.path.normpath(config.tokenizer_path))
    return "pdserve"


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig.from_args(args)
        config.tls.require_server_certificate()
        codec = TextCodec.from_path(config.tokenizer_path) if config.tokenizer_path else None
        api_token = config.auth.load(os.environ)
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    log_token_requirement(api_token)
    asyncio.run(run(config, env=dict(os.environ), codec=codec, api_token=api_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
