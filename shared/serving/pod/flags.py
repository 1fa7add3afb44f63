"""A pod's flags: its server settings (PodServerConfig) and its engine side's (PodConfig), each a dataclass
field with its help; the flags are generated from the fields."""
from __future__ import annotations

import argparse
import dataclasses

from shared.engine.kv_transfer.connector import KVRole
from shared.serving.server.grpc_server import ServerOptions
from shared.serving.server.handle_key import add_handle_key_flags
from shared.serving.server.cpu_limit import default_num_threads
from shared.serving.pod.runtime import CONSUMER_SETTINGS, PRODUCER_SETTINGS, PodConfig
from shared.serving.server.settings import add_flags, config_from_args, setting

# Where the KV data plane listens (UCX TCP, one port per network interface): declared in the manifests'
# NetworkPolicies, so it must be a fixed range, not UCX's ephemeral default.
DEFAULT_KV_PORT_RANGE = "20000-20099"


def parse_port_range(value: str) -> str:
    """'LOW-HIGH' with 1024 <= LOW <= HIGH <= 65535 (argparse type)."""
    low, separator, high = value.partition("-")
    if not (separator and low.isdigit() and high.isdigit() and 1024 <= int(low) <= int(high) <= 65535):
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PodServerConfig:
    """A pod's server settings, beside PodConfig's engine side: where it listens, its metrics and traces,
    its KV transfer ports and its drain. Each field is a flag (shared/serving/server/settings.py)."""

    host: str = dataclasses.field(default="127.0.0.1", metadata=setting("address to bind"))
    port: int = dataclasses.field(default=0, metadata=setting("gRPC port (0 = any free)"))
    metrics_port: int | None = dataclasses.field(default=None, metadata=setting(
        "Prometheus port (0 = any free; off if unset)"
    ))
    otlp_endpoint: str | None = dataclasses.field(default=None, metadata=setting(
        "OTLP/gRPC trace endpoint, e.g. http://127.0.0.1:4317"
    ))
    otel_sampling_ratio: float | None = dataclasses.field(default=None, metadata=setting(
        "trace sampling ratio in [0, 1]"
    ))
    kv_port_range: str = dataclasses.field(default=DEFAULT_KV_PORT_RANGE, metadata=setting(
        "LOW-HIGH: the TCP ports the NIXL/UCX KV transfer listens on", type=parse_port_range
    ))
    grace_seconds: float = dataclasses.field(default=ServerOptions.grace_seconds, metadata=setting(
        "on SIGTERM: how long requests in flight (and KV held for a peer) may take to finish"
    ))


def add_pod_flags(parser: argparse.ArgumentParser, *, default_port: int, role: KVRole | None) -> None:
    """The server flags every pod has (its own port the default), then one flag per PodConfig setting of
    the pod's role."""
    add_flags(parser, PodServerConfig, defaults={"port": default_port})
    other_roles = {KVRole.PRODUCER: CONSUMER_SETTINGS, KVRole.CONSUMER: PRODUCER_SETTINGS}
    add_flags(parser, PodConfig, exclude=other_roles.get(role, PRODUCER_SETTINGS + CONSUMER_SETTINGS))
    if role is not None:
        add_handle_key_flags(parser)


def pod_config_from_args(args: argparse.Namespace) -> PodConfig:
    """Without --num-threads, torch gets as many threads as the container's CPU limit allows."""
    config = config_from_args(PodConfig, args)
    if config.num_threads is None:
        config = dataclasses.replace(config, num_threads=default_num_threads())
    return config
