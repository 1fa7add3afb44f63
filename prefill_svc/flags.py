"""The prefill pod's flags: the shared pod flags, with the lease and the address decode pods reach it at."""
from __future__ import annotations

import argparse

from shared.engine.kv_transfer.connector import KVRole
from shared.serving.pod.runtime import PodConfig
from shared.serving.pod.flags import add_pod_flags, pod_config_from_args

DEFAULT_PORT = 50061


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description="Run a prefill pod (KV producer).")
    add_pod_flags(parser, default_port=DEFAULT_PORT, role=KVRole.PRODUCER)
    return parser


def pod_config(args: argparse.Namespace) -> PodConfig:
    return pod_config_from_args(args)
