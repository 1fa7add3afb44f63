"""Composition root of the router: flags -> config -> worker pools, servicer, gRPC server; runs until
SIGTERM/SIGINT. Start with `python -m router --prefill HOST:PORT --decode HOST:PORT`."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

from prometheus_client import CollectorRegistry

from proto.pdserve.v1 import decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc
from router.flags import RouterConfig, build_arg_parser
from router.kv_index import KvIndex
from router.kv_subscriptions import KvEventSubscriptions
from router.metrics import RouterMetrics
from router.servicer import RouterServicer
from shared.serving.text import TextCodec
from router.workers import WorkerPool
from shared.serving.api_auth import BearerTokenInterceptor
from shared.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer, ServerOptions
from shared.serving.http_api import HttpFront, HttpServer
from shared.serving.metrics import start_metrics_server
from shared.serving.prefill_client import PrefillClient
from shared.serving.telemetry import TracingConfig, setup_tracing

logger = logging.getLogger("router")

GENERATE_SERVICE = "pdserve.v1.GenerateService"
PREFILL_SERVICE = "pdserve.v1.PrefillService"
DECODE_SERVICE = "pdserve.v1.DecodeService"


async def run(
    config: RouterConfig, *, env: dict[str, str], codec: TextCodec | None = None, api_token: str | None = None
) -> None:
    """api_token: the bearer token Generate callers must send, if any."""
    tracing = setup_tracing(
        TracingConfig.from_flags_and_env(env, default_service_name="pdserve-router", otlp_endpoint=config.otlp_endpoint)
    )
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    metrics_server = (
        start_metrics_server(registry, config.host, config.metrics_port) if config.metrics_port is not None else None
    )
    interceptors = list(tracing.server_interceptors())
    if api_token is not None:
        interceptors.append(BearerTokenInterceptor(api_token))
    server = GrpcServer(
        ServerOptions(host=config.host, port=config.port, grace_seconds=config.grace_seconds, tls=config.tls),
        interceptors=interceptors,
    )

    async def update_health() -> None:
        # Readiness: the router can serve only when both tiers have at least one healthy worker. Liveness
        # (GrpcServer's "liveness" service) does not follow the tiers: a router waiting for them still works.
        if server.is_started:
            await server.set_serving(prefill.has_healthy and decode.has_healthy)
        if subscriptions is not None:
            subscriptions.sync([*prefill.addresses, *decode.addresses])

    pool_wiring = dict(
        channel_options=[
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            # A restarted pod is back within seconds: reconnect at most a second after it is.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
        interceptors=tracing.client_interceptors(),
        on_poll=update_health,
        tls=config.tls,
    )
    # Each router replica follows every pod's KV events itself: same events, same index.
    kv_index = KvIndex(config.kv_index_max_blocks) if config.needs_kv_index else None
    subscriptions = (
        KvEventSubscriptions(kv_index, pool_wiring["channel_options"], tls=config.tls) if kv_index is not None else None
    )
    prefill = WorkerPool(
        "prefill", config.prefill, prefill_pb2_grpc.PrefillServiceStub, PREFILL_SERVICE, config.pool,
        client_class=lambda channel: PrefillClient(channel, config.prefill_client), **pool_wiring,
    )
    decode = WorkerPool(
        "decode", config.decode, decode_pb2_grpc.DecodeServiceStub, DECODE_SERVICE, config.pool, **pool_wiring
    )
    servicer = RouterServicer(prefill, decode, config, codec=codec, metrics=metrics, tracer=tracing.tracer,
                              kv_index=kv_index)
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, GENERATE_SERVICE)
    http = None
    if config.http.http_port is not None:
        front = HttpFront(
            servicer.Generate, model_name=served_model_name(config), codec=lambda: codec,
            registry=registry, is_ready=lambda: prefill.has_healthy and decode.has_healthy,
            max_model_len=lambda: servicer.max_model_len, api_key=api_token, tracer=lambda: tracing.tracer,
        )
        http = HttpServer(front.app, config.host, config.http.http_port)
        server.on_shutdown(http.stop)
    server.on_shutdown(servicer.drain)
    try:
        await server.start()
        if http is not None:
            await http.start()
        await prefill.start()
        await decode.start()
        await update_health()
        print(f"router listening on {server.address} (prefill: {', '.join(prefill.addresses)}; "
              f"decode: {', '.join(decode.addresses)}; policy {config.policy})", flush=True)
        if metrics_server is not None:
            print(f"router metrics at {metrics_server.url}", flush=True)
        if http is not None:
            print(f"router OpenAI-compatible HTTP API at {http.url}/v1", flush=True)
        await server.serve_forever()
    finally:
        await server.stop()
        if http is not None:
            await http.stop()
        if subscriptions is not None:
            await subscriptions.close()
        await prefill.close()
        await decode.close()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()


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
        codec = TextCodec.from_path(config.tokenizer_path) if config.tokenizer_path else None
        api_token = config.auth.load(os.environ)
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run(config, env=dict(os.environ), codec=codec, api_token=api_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
