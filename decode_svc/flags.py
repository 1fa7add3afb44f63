"""The decode pod's flags: the shared pod flags, with what to do when pulled KV is not known good and
how long its calls to prefill pods may take."""
from __future__ import annotations

import argparse

from shared.engine.kv_transfer.connector import KVRole
from shared.serving.pod.runtime import PodConfig
from shared.serving.pod.flags import add_pod_flags, pod_config_from_args
from shared.serving.prefill_client import PrefillClientConfig
from shared.serving.server.settings import add_flags, config_from_args

DEFAULT_PORT = 50071


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve decode", description="Run a decode pod (KV consumer).")
    add_pod_flags(parser, default_port=DEFAULT_PORT, role=KVRole.CONSUMER)
    add_flags(parser, PrefillClientConfig)
    return parser


def pod_config(args: argparse.Namespace) -> PodConfig:
    return pod_config_from_args(args)


def prefill_client_config(args: argparse.Namespace) -> PrefillClientConfig:
    return config_from_args(PrefillClientConfig, args)
