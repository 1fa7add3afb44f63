"""Composition root of the planner: flags -> config -> Planner, planning loop, KEDA external scaler
gRPC server and /metrics; runs until SIGTERM/SIGINT. Start with `pdserve planner --router-metrics ...`."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from prometheus_client import CollectorRegistry

from planner.decision import Planner
from planner.flags import PlannerConfig, build_arg_parser
from planner.keda_scaler import SERVICE_NAME, DesiredReplicas, ExternalScalerServicer
from planner.loop import PlanningLoop
from planner.metrics import PlannerMetrics
from proto.externalscaler import externalscaler_pb2_grpc
from shared.serving.server.grpc_server import GrpcServer, ServerOptions, serve_until_stopped
from shared.serving.server.metrics import start_metrics_server


async def run(config: PlannerConfig) -> None:
    closers = contextlib.AsyncExitStack()
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    policy = config.policy
    planner = Planner(policy, num_prefill=policy.min_prefill, num_decode=policy.min_decode)
    desired = DesiredReplicas(planner.current["prefill"], planner.current["decode"])
    loop = PlanningLoop(planner, {"router": config.router_metrics, "prefill": config.prefill_metrics,
                                  "decode": config.decode_metrics}, desired, metrics, config.scrape_timeout_s)
    server = scaler_server(config, desired)

    async def start() -> list[str]:
        await server.start()
        lines = [f"planner listening on {server.address} (KEDA external scaler)"]
        if config.metrics_port is not None:
            metrics_server = start_metrics_server(registry, config.host, config.metrics_port)
            closers.callback(metrics_server.stop)
            lines.append(f"planner metrics at {metrics_server.url}")
        task = asyncio.get_running_loop().create_task(loop.run())
        closers.callback(task.cancel)
        await server.set_serving(True)
        return lines

    await serve_until_stopped(server, start, closers)


def scaler_server(config: PlannerConfig, desired: DesiredReplicas) -> GrpcServer:
    """The gRPC server KEDA calls: the external scaler protocol (plus health and reflection)."""
    server = GrpcServer(ServerOptions(host=config.host, port=config.port, grace_seconds=config.grace_seconds))
    server.add_service(externalscaler_pb2_grpc.add_ExternalScalerServicer_to_server,
                       ExternalScalerServicer(desired), SERVICE_NAME)
    return server


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = PlannerConfig.from_args(args)
    except ValueError as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
