"""Composition root of a prefill pod: `python -m prefill_svc --port 50061 --model tiny`."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys

from prefill_svc.flags import build_arg_parser, pod_config
from prefill_svc.servicer import PrefillServicer
from proto.pdserve.v1 import prefill_pb2_grpc
from shared.engine.kv_transfer.connector import KVRole
from shared.serving.server.handle_key import handle_key_from_args
from shared.serving.pod.kv_events import kv_event_service
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.serve import run_pod

SERVICE_NAME = "pdserve.v1.PrefillService"


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(name)s: %(message)s")
    try:
        config = dataclasses.replace(pod_config(args), kv_handle_key=handle_key_from_args(args, os.environ))
    except ValueError as exc:
        sys.exit(f"pdserve prefill: {exc}")
    servicer = PrefillServicer(ServiceMetrics())
    services = [(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer, SERVICE_NAME), kv_event_service()]
    asyncio.run(
        run_pod(KVRole.PRODUCER, args, config, env=dict(os.environ), service_name="prefill", services=services)
    )


if __name__ == "__main__":
    main()
