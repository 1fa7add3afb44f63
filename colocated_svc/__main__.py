"""Composition root of the colocated server: `python -m colocated_svc --port 50061 --model tiny`.
Flags are the pods' shared flags (shared/serving/pod_server.py) plus --tokenizer for text prompts."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from colocated_svc.servicer import ColocatedServicer
from proto.pdserve.v1 import generate_pb2_grpc
from shared.engine.tokenizer import load_tokenizer
from shared.serving.metrics import ServiceMetrics
from shared.serving.pod_server import add_pod_flags, pod_config_from_args, run_pod

SERVICE_NAME = "pdserve.v1.GenerateService"
DEFAULT_PORT = 50061


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve colocated", description="Serve the Generate API from one colocated pod (no router)."
    )
    add_pod_flags(parser, default_port=DEFAULT_PORT, role=None)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (or a directory holding one) for text prompts; default: the model's")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s colocated %(levelname)s %(name)s: %(message)s")
    try:
        config = pod_config_from_args(args)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    except ValueError as exc:
        print(f"pdserve colocated: {exc}", file=sys.stderr)
        return 2
    servicer = ColocatedServicer(ServiceMetrics(), tokenizer=tokenizer)
    services = [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, SERVICE_NAME)]
    # Role None: no KV connector, the pod runs whole requests itself.
    asyncio.run(run_pod(None, args, config, env=dict(os.environ), service_name="colocated", services=services))
    return 0


if __name__ == "__main__":
    sys.exit(main())
