"""The key the prefill and decode pods of one deployment share to sign KV handles: where it comes from
(a file, or the environment) and the rule that a split pod needs one unless told to run unsigned."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Mapping

from shared.engine.kv_transfer.handle_signing import MIN_KEY_BYTES
from shared.serving.server.secret_file import read_secret_file
from shared.serving.server.settings import add_flags, config_from_args, setting

# Read when no key file is given; `pdserve up` and LocalCluster set it for every pod they start.
KEY_ENV_VAR = "PDSERVE_KV_HANDLE_KEY"


@dataclass(frozen=True)
class HandleKeyConfig:
    """Where a split pod's handle key comes from."""

    kv_handle_key_file: str = field(default="", metadata=setting(
        f"file holding the KV handle key every prefill and decode pod of the deployment shares (at least "
        f"{MIN_KEY_BYTES} bytes of text; default: the {KEY_ENV_VAR} environment variable)"
    ))
    insecure_unsigned_handles: bool = field(default=False, metadata=setting(
        "run without a handle key: handles are not signed nor checked, so anyone who can reach the decode "
        "pods can make them read any held block (prompt binding still applies); for local experiments only"
    ))

    def load(self, env: Mapping[str, str]) -> bytes | None:
        """The key's bytes (None when running unsigned); ValueError when none is configured."""
        if self.insecure_unsigned_handles:
            return None
        if self.kv_handle_key_file:
            text = read_secret_file(self.kv_handle_key_file, "--kv-handle-key-file")
        else:
            text = env.get(KEY_ENV_VAR, "")
        key = text.strip().encode()
        if not key:
            raise ValueError(
                f"no KV handle key: give --kv-handle-key-file or set {KEY_ENV_VAR} (the same key on every prefill "
                "and decode pod), or pass --insecure-unsigned-handles to run without one"
            )
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the KV handle key has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
        return key


def add_handle_key_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, HandleKeyConfig)


def handle_key_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> bytes | None:
    return config_from_args(HandleKeyConfig, args).load(env)
