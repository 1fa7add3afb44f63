"""The prefill pod's flags: the shared pod flags plus the lease and the address decode pods reach it at."""
from __future__ import annotations

import argparse

from shared.serving.pod_runtime import PodConfig
from shared.serving.pod_server import add_pod_flags, pod_config_from_args

DEFAULT_PORT = 50061


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description="Run a prefill pod (KV producer).")
    add_pod_flags(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--advertise-address",
        default="",
        help="host:port decode pods use to reach this pod (default: the bound host:port)",
    )
    parser.add_argument(
        "--lease-s", type=float, default=PodConfig.lease_s, help="seconds a prompt's KV is held for its pull"
    )
    return parser


def pod_config(args: argparse.Namespace) -> PodConfig:
    return pod_config_from_args(args, lease_s=args.lease_s, advertise_address=args.advertise_address)
