"""The floors stay apart: the engine imports no grpc, proto or OpenTelemetry, the router no NIXL transport
(nor torch), and services never import each other. Checked statically over every import statement (the
fast lane), and once more by importing in a fresh interpreter (e2e: what third-party packages pull in)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("router", "prefill_svc", "decode_svc", "colocated_svc")
FIRST_PARTY = ("shared", "proto", "pdserve", *SERVICES)
NOT_IN_THE_ENGINE = {"grpc", "grpc_health", "grpc_reflection", "google", "opentelemetry", "proto"}
NOT_IN_THE_ROUTER = {"nixl", "nixl_cu12", "nixl_cu13", "torch", "numpy", "triton"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def first_party_modules() -> dict[str, Path]:
    return {module_name(path): path for top in FIRST_PARTY for path in (REPO / top).rglob("*.py")}


@cache
def imported_by(module: str) -> frozenset[str]:
    """Every module an import statement anywhere in the module names (function bodies too, so a lazy import
    counts; `if TYPE_CHECKING:` blocks do not), relative imports resolved."""
    path = first_party_modules()[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in statements(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in first_party_modules())
    return frozenset(names)


def statements(node: ast.AST):
    """Every node under `node`, except what an `if TYPE_CHECKING:` block holds."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for orelse in child.orelse for n in (orelse, *statements(orelse)))
            continue
        yield child
        yield from statements(child)


def import_closure(start: list[str]) -> tuple[set[str], set[str]]:
    """The first-party modules reachable from `start` (parent packages included) and the top-level names
    of the third-party packages they import."""
    modules = first_party_modules()
    reached: set[str] = set()
    third_party: set[str] = set()
    pending = list(start)
    while pending:
        module = pending.pop()
        if module in reached:
            continue
        reached.add(module)
        parts = module.split(".")
        pending.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        for name in imported_by(module) if module in modules else ():
            if name.split(".")[0] in FIRST_PARTY:
                pending.append(name)
            else:
                third_party.add(name.split(".")[0])
    return reached, third_party


def engine_modules() -> list[str]:
    return sorted(m for m in first_party_modules() if m == "shared.engine" or m.startswith("shared.engine."))


def test_engine_modules_are_found():
    names = engine_modules()
    assert "shared.engine.llm_engine" in names and "shared.engine.kv_transfer.nixl_connector" in names


def test_engine_imports_no_grpc_proto_opentelemetry_or_serving_floor():
    reached, third_party = import_closure(engine_modules())
    assert "torch" in third_party   # the check sees real imports
    assert not third_party & NOT_IN_THE_ENGINE
    outside = sorted(m for m in reached if not (m == "shared" or m.startswith("shared.engine")))
    assert not outside, f"the engine floor imports {outside}"


def test_router_imports_no_nixl_and_no_torch():
    router = sorted(m for m in first_party_modules() if m.split(".")[0] == "router")
    reached, third_party = import_closure(router)
    assert "grpc" in third_party and "shared.serving" in reached   # the check sees real imports
    assert not third_party & NOT_IN_THE_ROUTER, sorted(third_party & NOT_IN_THE_ROUTER)


def test_services_never_import_each_other_and_shared_imports_no_service():
    offenders = []
    for module in first_party_modules():
        home = module.split(".")[0]
        for name in imported_by(module):
            target = name.split(".")[0]
            if target in SERVICES and target != home and home in (*SERVICES, "shared"):
                offenders.append(f"{module} imports {name}")
    assert not offenders, offenders


def loaded_top_level_modules(modules: list[str]) -> set[str]:
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.e2e
def test_engine_loads_no_grpc_proto_or_opentelemetry():
    loaded = loaded_top_level_modules(engine_modules())
    assert not loaded & NOT_IN_THE_ENGINE


@pytest.mark.e2e
def test_router_loads_no_nixl_and_no_torch():
    loaded = loaded_top_level_modules(["router.__main__", "router.servicer", "router.workers", "router.policy"])
    assert "grpc" in loaded  # the check sees real imports
    assert not loaded & NOT_IN_THE_ROUTER
