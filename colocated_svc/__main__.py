"""Composition root of the colocated server: `python -m colocated_svc --port 50061 --model tiny`.
Flags are the pods' shared flags (shared/serving/pod/flags.py), --tokenizer for text prompts and the
HTTP front's (--http-port)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from colocated_svc.servicer import ColocatedServicer
from proto.pdserve.v1 import generate_pb2_grpc
from shared.serving.server.api_auth import ApiAuthConfig, log_token_requirement
from shared.serving.server.http_server import HttpServer
from shared.serving.openai.app import HttpFront
from shared.serving.openai.config import HttpConfig
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.flags import add_pod_flags, pod_config_from_args
from shared.serving.pod.serve import run_pod
from shared.serving.server.settings import add_flags, config_from_args
from shared.serving.text import TextCodec
from shared.serving.server.tls import TlsConfig

SERVICE_NAME = "pdserve.v1.GenerateService"
DEFAULT_PORT = 50061


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve colocated", description="Serve the Generate API from one colocated pod (no router)."
    )
    add_pod_flags(parser, default_port=DEFAULT_PORT, role=None)
    add_flags(parser, ApiAuthConfig)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (or a directory holding one) for text prompts; default: the model's")
    add_flags(parser, HttpConfig)
    return parser


def load_codec(tokenizer: str | None, model: str) -> TextCodec | None:
    """The --tokenizer's codec, else the model's (a preset's or a directory's), else None."""
    if tokenizer is not None:
        return TextCodec.from_path(tokenizer)
    try:
        return TextCodec.from_path(model)
    except ValueError:
        return None  # a model without tokenizer.json serves token ids only


def http_server(
    args, http: HttpConfig, servicer: ColocatedServicer, codec: TextCodec | None, api_token: str | None,
    tls: TlsConfig,
) -> HttpServer | None:
    """The HTTP front when --http-port is set: HTTPS, and mTLS, with the gRPC server's TLS settings."""
    if http.http_port is None:
        return None
    front = HttpFront(
        servicer.generate,
        model_name=http.served_model_name or os.path.basename(os.path.normpath(args.model)),
        codec=lambda: codec,
        registry=servicer.metrics.registry,
        is_ready=lambda: servicer.pod is not None and not servicer.is_draining,
        max_model_len=lambda: servicer.pod.max_model_len if servicer.pod is not None else None,
        api_key=api_token,
        tracer=lambda: servicer.tracing.tracer,  # run_pod hands the servicer its tracing
        config=http,
        model_aliases=(args.model,),
    )
    return HttpServer(front.app, args.host, http.http_port, tls)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s colocated %(levelname)s %(name)s: %(message)s")
    try:
        config = pod_config_from_args(args)
        config.tls.require_server_certificate()
        http = config_from_args(HttpConfig, args)
        codec = load_codec(args.tokenizer, config.model)
        api_token = config_from_args(ApiAuthConfig, args).load(os.environ)
    except ValueError as exc:
        print(f"pdserve colocated: {exc}", file=sys.stderr)
        return 2
    log_token_requirement(api_token)
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=codec.tokenizer if codec is not None else None)
    services = [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, SERVICE_NAME)]
    try:
        front = http_server(args, http, servicer, codec, api_token, config.tls)
    except (OSError, ValueError) as exc:  # the port is taken; --tls-ca without a certificate to serve
        print(f"pdserve colocated: {exc}", file=sys.stderr)
        return 2
    # Role None: no KV connector, the pod runs whole requests itself.
    asyncio.run(run_pod(
        None, args, config, env=dict(os.environ), service_name="colocated", services=services, http=front,
        api_token=api_token,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
