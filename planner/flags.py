"""The planner service's configuration: where to read metrics, where to serve KEDA's protocol, and
the scaling policy (a frozen dataclass; flags generated from its fields)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from planner.policy import ScalingPolicy
from planner.scrape import Target, parse_targets
from shared.serving.server.settings import add_flags, config_from_args, setting, settings_group


@dataclass(frozen=True)
class PlannerConfig:
    router_metrics: tuple[Target, ...] = field(metadata=setting(
        "the router's metrics endpoints: host:port or dns:name:port; repeatable or comma separated",
        parse=parse_targets, action="append", metavar="ADDR"))
    prefill_metrics: tuple[Target, ...] = field(metadata=setting(
        "the prefill pods' metrics endpoints (dns:name:port finds every pod behind a headless Service)",
        parse=parse_targets, action="append", metavar="ADDR"))
    decode_metrics: tuple[Target, ...] = field(metadata=setting(
        "the decode pods' metrics endpoints", parse=parse_targets, action="append", metavar="ADDR"))
    host: str = field(default="127.0.0.1", metadata=setting("address the KEDA external scaler listens on"))
    port: int = field(default=50090, metadata=setting("KEDA external scaler gRPC port (0 picks one)"))
    metrics_port: int | None = field(default=None, metadata=setting("the planner's own /metrics port (off when unset)"))
    scrape_timeout_s: float = field(default=2.0, metadata=setting(
        "seconds one /metrics fetch may take", flag="--scrape-timeout"))
    grace_seconds: float = field(default=2.0, metadata=setting("graceful shutdown period"))
    policy: ScalingPolicy = field(default_factory=ScalingPolicy, metadata=settings_group())

    def __post_init__(self) -> None:
        for name in ("router_metrics", "prefill_metrics", "decode_metrics"):
            if not getattr(self, name):
                raise ValueError(f"--{name.replace('_', '-')} is required (host:port or dns:name:port)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not self.scrape_timeout_s > 0 or self.grace_seconds < 0:
            raise ValueError("scrape_timeout_s must be > 0 and grace_seconds >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlannerConfig":
        return config_from_args(cls, args)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve planner",
        description="pdserve planner: chooses the prefill and decode replica counts from the pods' metrics "
                    "and serves them over KEDA's external scaler protocol")
    add_flags(parser, PlannerConfig)
    return parser
