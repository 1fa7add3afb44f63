"""Composition root of the colocated server: `python -m colocated_svc --port 50061 --model tiny`.
Flags are the pods' shared flags (shared/pod_main.py) plus --tokenizer for text prompts."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Mapping

from colocated_svc.servicer import ColocatedServicer
from proto.pdserve.v1 import generate_pb2_grpc
from shared.grpc_server import GrpcServer, ServerOptions
from shared.metrics import ServiceMetrics, start_metrics_server
from shared.pod import Pod, PodConfig
from shared.pod_main import add_pod_flags, pod_config_from_args, refresh_gauges
from shared.telemetry import TracingConfig, setup_tracing

SERVICE_NAME = "pdserve.v1.GenerateService"
DEFAULT_PORT = 50061


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve colocated", description="Serve the Generate API from one colocated pod (no router)."
    )
    add_pod_flags(parser, default_port=DEFAULT_PORT)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (or a directory holding one) for text prompts; default: the model's")
    return parser


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from pathlib import Path

    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"tokenizer file not found: {file}")
    return Tokenizer.from_file(str(file))


async def serve(args: argparse.Namespace, pod_config: PodConfig, servicer: ColocatedServicer, *,
                env: Mapping[str, str]) -> None:
    """Health NOT_SERVING while the model loads, SERVING until SIGTERM/SIGINT, then drain.
    (shared/pod_main.run_pod does the same for a pod with a KV role.)"""
    tracing = setup_tracing(
        TracingConfig.from_flags_and_env(
            env,
            default_service_name="pdserve-colocated",
            otlp_endpoint=args.otlp_endpoint,
            sampling_ratio=args.otel_sampling_ratio,
        )
    )
    server = GrpcServer(ServerOptions(host=args.host, port=args.port), interceptors=tracing.server_interceptors())
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, SERVICE_NAME)
    metrics_server = None
    gauges = None
    try:
        await server.start()
        pod = await asyncio.get_running_loop().run_in_executor(None, Pod, None, pod_config)
        pod.start()
        server.on_shutdown(pod.stop)
        servicer.attach(pod)
        if args.metrics_port is not None:
            metrics_server = start_metrics_server(servicer.metrics.registry, args.host, args.metrics_port)
        gauges = asyncio.ensure_future(refresh_gauges(pod, servicer.metrics))
        await server.set_serving(True)
        print(f"colocated listening on {server.address} (engine {pod.engine_id})", flush=True)
        if metrics_server is not None:
            print(f"colocated metrics at {metrics_server.url}", flush=True)
        await server.serve_forever()
    finally:
        if gauges is not None:
            gauges.cancel()
        await server.stop()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s colocated %(levelname)s %(name)s: %(message)s")
    try:
        config = pod_config_from_args(args)
        tokenizer = load_tokenizer(args.tokenizer)
    except ValueError as exc:
        print(f"pdserve colocated: {exc}", file=sys.stderr)
        return 2
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=tokenizer)
    asyncio.run(serve(args, config, servicer, env=dict(os.environ)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
