"""`pdserve up --autoscale`: the planner (planner/) runs in this process and scales the local prefill and
decode pods itself (pdserve/local_pods.py) within --max-pods, instead of publishing counts to KEDA."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry

from pdserve.launcher import HOST, LocalCluster, ServiceProcess, free_port, wait_serving
from pdserve.local_pods import LocalPods, PodTimings
from planner.decision import TIERS, Planner
from planner.keda_scaler import DesiredReplicas
from planner.loop import PlanningLoop
from planner.metrics import PlannerMetrics
from planner.policy import ScalingPolicy
from planner.scrape import parse_target
from shared.serving.server.settings import add_flags, config_from_args, setting, settings_group

# The router re-reads the worker list files this often: a pod joins or leaves the rotation within it.
RESOLVE_INTERVAL_S = 1.0
SCRAPE_TIMEOUT_S = 5.0  # a pod busy on both cores answers /metrics late


@dataclass(frozen=True)
class AutoscaleConfig:
    autoscale: bool = field(default=False, metadata=setting(
        "let the planner (docs/planner.md) start and drain local prefill and decode pods within --max-pods, "
        "from --prefill-pods and --decode-pods; each pod runs one torch thread, unpinned, on a free port"))
    drain_seconds: float = field(default=300.0, metadata=setting(
        "how long a pod being scaled down may take to finish its requests (its --grace-seconds)"))
    policy: ScalingPolicy = field(default_factory=ScalingPolicy, metadata=settings_group())

    def __post_init__(self) -> None:
        if self.autoscale and self.policy.max_pods is None:
            raise ValueError("--autoscale needs --max-pods (the most prefill and decode pods together)")
        if not self.drain_seconds > 0:
            raise ValueError(f"--drain-seconds must be > 0, got {self.drain_seconds}")

    def check_start(self, num_prefill: int, num_decode: int) -> None:
        """The counts `up` starts from must be ones the planner could have chosen."""
        policy = self.policy
        for tier, count in (("prefill", num_prefill), ("decode", num_decode)):
            low, high = getattr(policy, f"min_{tier}"), getattr(policy, f"max_{tier}")
            if not low <= count <= high:
                raise ValueError(f"--{tier}-pods {count} is outside --min-{tier} {low} .. --max-{tier} {high}")
        if num_prefill + num_decode > policy.max_pods:
            raise ValueError(f"--prefill-pods + --decode-pods ({num_prefill + num_decode}) exceed --max-pods "
                             f"{policy.max_pods}")


def add_autoscale_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("autoscale (with --autoscale; the planner's policy)"), AutoscaleConfig)


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    return config_from_args(AutoscaleConfig, args)


@dataclass(frozen=True)
class Launch:
    """What `up` hands over: the flags of each tier's pods and of the router, and how to show the system."""

    tier_args: dict[str, Sequence[str]]
    router_args: Sequence[str]
    announce: Callable[[list[ServiceProcess]], None]  # prints the services once they serve
    demo: Callable[[str], None] | None  # asks the example question through the router's HTTP API, then stop


def run_autoscaled(args: argparse.Namespace, config: AutoscaleConfig, launch: Launch) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(message)s", force=True)
    cluster = LocalCluster(with_metrics=True)
    try:
        asyncio.run(_serve(args, config, launch, cluster))
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        cluster.stop()


def pod_flags(config: AutoscaleConfig, pod_args: Sequence[str], tier_args: Sequence[str]) -> list[str]:
    """One torch thread per pod, unpinned (docs/planner.md: how pods share the cores); the user's flags win."""
    return ["--num-threads", "1", "--grace-seconds", str(config.drain_seconds), *pod_args, *tier_args]


async def _serve(args: argparse.Namespace, config: AutoscaleConfig, launch: Launch, cluster: LocalCluster) -> None:
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stopping.set)
    sources: dict = {}
    pods = LocalPods(cluster, launch.tier_args, args.log_dir, PodTimings(drain_s=config.drain_seconds),
                     on_change=lambda: sources.update({tier: pods.metrics_targets(tier) for tier in TIERS}))
    try:
        await pods.start_initial({"prefill": args.prefill_pods, "decode": args.decode_pods})
        router = await start_router(cluster, pods, log_dir=args.log_dir, port=args.port, http_port=args.http_port,
                                    router_args=launch.router_args)
        launch.announce([router, *(pod.service for pod in pods.pods)])
        if launch.demo is not None:
            return await asyncio.to_thread(launch.demo, router.http_url)
        sources["router"] = (parse_target(router.metrics_url.removeprefix("http://").removesuffix("/metrics")),)
        loop = planning_loop(config.policy, pods, sources)
        print(f"autoscaling: {config.policy.min_prefill}-{config.policy.max_prefill} prefill, "
              f"{config.policy.min_decode}-{config.policy.max_decode} decode, at most {config.policy.max_pods} "
              f"pods; a decision every {config.policy.interval_s:g} s (Ctrl-C stops)", flush=True)
        planning = asyncio.get_running_loop().create_task(loop.run())
        await _until_stopped(stopping, router)
        planning.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await planning
        await asyncio.to_thread(router.stop)  # first: it finishes its calls while the pods still serve them
    finally:
        await pods.close()


def planning_loop(policy: ScalingPolicy, pods: LocalPods, sources: dict) -> PlanningLoop:
    counts = {tier: len(pods.of(tier)) for tier in TIERS}
    planner = Planner(policy, num_prefill=counts["prefill"], num_decode=counts["decode"])
    desired = DesiredReplicas(counts["prefill"], counts["decode"])
    return PlanningLoop(planner, sources, desired, PlannerMetrics(CollectorRegistry()), SCRAPE_TIMEOUT_S,
                        actuator=pods.apply)


async def start_router(cluster: LocalCluster, pods: LocalPods, *, log_dir: Path, port: int | None,
                       http_port: int | None, router_args: Sequence[str]) -> ServiceProcess:
    """The router reads each tier from its worker list file (--prefill file:PATH), re-read every second."""
    http_port = http_port or free_port()
    routing = ["--prefill", f"file:{pods.list_file('prefill')}", "--decode", f"file:{pods.list_file('decode')}",
               "--http-port", str(http_port), "--resolve-interval", str(RESOLVE_INTERVAL_S)]
    router = cluster.start_process("router", "router", [*routing, *router_args], log_dir, cluster.env, port)
    router.http_url = f"http://{HOST}:{http_port}/v1"
    await asyncio.to_thread(wait_serving, router, 600, cluster.client_tls)
    pods.router_metrics_url = router.metrics_url
    return router


async def _until_stopped(stopping: asyncio.Event, router: ServiceProcess) -> None:
    while not stopping.is_set() and router.is_running():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), 0.5)
    print("stopping" if stopping.is_set() else "stopping: the router exited", flush=True)
