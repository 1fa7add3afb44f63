"""The two floors stay apart: the engine loads no grpc, proto or OpenTelemetry, and the router loads no
NIXL transport (nor torch). Each check imports in a fresh interpreter, so earlier tests' imports do not count."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import shared.engine

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def loaded_top_level_modules(modules: list[str]) -> set[str]:
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def engine_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(shared.engine.__path__, "shared.engine.")]


def test_engine_modules_are_found():
    names = engine_modules()
    assert "shared.engine.llm_engine" in names and "shared.engine.kv_transfer.nixl_connector" in names


def test_engine_loads_no_grpc_proto_or_opentelemetry():
    loaded = loaded_top_level_modules(engine_modules())
    assert not loaded & {"grpc", "grpc_health", "grpc_reflection", "proto", "google", "opentelemetry"}


def test_router_loads_no_nixl_and_no_torch():
    loaded = loaded_top_level_modules(["router.__main__", "router.servicer", "router.workers", "router.policy"])
    assert "grpc" in loaded  # the check sees real imports
    assert not loaded & {"nixl_cu12", "nixl", "torch", "numpy"}
