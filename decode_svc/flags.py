"""The decode pod's flags: the shared pod flags plus what to do when pulled KV is not known good."""
from __future__ import annotations

import argparse

from shared.engine.kv_transfer.connector import KVLoadFailurePolicy
from shared.serving.pod_runtime import PodConfig
from shared.serving.pod_server import add_pod_flags, pod_config_from_args

DEFAULT_PORT = 50071


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve decode", description="Run a decode pod (KV consumer).")
    add_pod_flags(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=[policy.value for policy in KVLoadFailurePolicy],
        default=KVLoadFailurePolicy.RECOMPUTE.value,
        help="recompute the prompt locally (default) or fail the request when pulled KV is not known good",
    )
    return parser


def pod_config(args: argparse.Namespace) -> PodConfig:
    return pod_config_from_args(args, kv_load_failure_policy=KVLoadFailurePolicy(args.kv_load_failure_policy))
