"""How a command-line client reaches a router or server that asks for TLS or a bearer token: the services'
own flags (--tls-*, --api-token-file, PDSERVE_API_TOKEN), for pdserve generate, health and bench."""
from __future__ import annotations

import argparse
import os

from shared.serving.server.api_auth import ApiAuthConfig
from shared.serving.server.settings import add_flags, config_from_args
from shared.serving.server.tls import TlsConfig


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TlsConfig)
    add_flags(parser, ApiAuthConfig)


def connection_from_args(args: argparse.Namespace) -> dict:
    """PdserveClient's tls and api_token; ValueError when a file cannot be read."""
    return dict(tls=config_from_args(TlsConfig, args), api_token=config_from_args(ApiAuthConfig, args).load(os.environ))
