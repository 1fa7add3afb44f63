"""Composition root of a decode pod: `python -m decode_svc --port 50071 --model tiny`."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys

from decode_svc.flags import build_arg_parser, pod_config, prefill_client_config
from decode_svc.kv_sources import KvSourceCache
from decode_svc.servicer import DecodeServicer
from proto.pdserve.v1 import decode_pb2_grpc
from shared.engine.kv_transfer.connector import KVRole
from shared.serving.server.handle_key import handle_key_from_args
from shared.serving.pod.kv_events import kv_event_service
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.runtime import PodConfig
from shared.serving.pod.serve import run_pod
from shared.serving.prefill_client import PrefillClientConfig

SERVICE_NAME = "pdserve.v1.DecodeService"


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(name)s: %(message)s")
    try:
        config = dataclasses.replace(pod_config(args), kv_handle_key=handle_key_from_args(args, os.environ))
        client_config = prefill_client_config(args)
    except ValueError as exc:
        sys.exit(f"pdserve decode: {exc}")
    asyncio.run(serve(args, config, client_config))


async def serve(args, config: PodConfig, client_config: PrefillClientConfig) -> None:
    # The connector confirms each pull through the source cache (ReleaseKv on this event loop).
    sources = KvSourceCache(client_config, probe_port_range=args.kv_port_range, tls=config.tls,
                            loop=asyncio.get_running_loop())
    servicer = DecodeServicer(ServiceMetrics(), sources)
    services = [(decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, SERVICE_NAME), kv_event_service()]
    await run_pod(KVRole.CONSUMER, args, config, env=dict(os.environ), service_name="decode", services=services,
                  confirm_release=sources.confirm_release)


if __name__ == "__main__":
    main()
