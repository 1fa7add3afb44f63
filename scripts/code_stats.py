"""Code-size figures anyone can reproduce: lines of Python per package (shared/ per folder), every
hand-written module over the 400-line limit, the longest functions (and every one over the 60-line limit).
Generated stubs (*_pb2*.py) are left out. Run from a repo root:
    python scripts/code_stats.py [--top 10]
"""
from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

PACKAGES = ("shared", "prefill_svc", "decode_svc", "colocated_svc", "router", "pdserve", "benchmarks", "scripts",
            "tests")
# Product code: what the limits apply to (benchmarks, scripts and tests are counted, not judged).
PRODUCT = ("shared", "prefill_svc", "decode_svc", "colocated_svc", "router", "pdserve")
MODULE_LIMIT = 400
FUNCTION_LIMIT = 60


def python_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "_pb2" not in p.name)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def package_of(root: Path, path: Path) -> str:
    """shared/ per folder (shared/engine/sched, shared/serving/openai, ...), the rest per top-level package."""
    parts = path.relative_to(root).parts
    return "/".join(parts[:-1][:3]) if parts[0] == "shared" else parts[0]


def lines_per_package(root: Path) -> dict[str, int]:
    counts: dict[str, int] = collections.Counter()
    for package in PACKAGES:
        for path in python_files(root, package):
            counts[package_of(root, path)] += line_count(path)
    return dict(sorted(counts.items()))


def oversized_modules(root: Path) -> list[tuple[int, str]]:
    found = [(line_count(path), str(path.relative_to(root)))
             for package in PRODUCT for path in python_files(root, package)]
    return sorted((item for item in found if item[0] > MODULE_LIMIT), reverse=True)


def functions(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line Class.function") of every product function and method."""
    found = []
    for package in PRODUCT:
        for path in python_files(root, package):
            found.extend(_functions_in(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(root)), ""))
    return sorted(found, reverse=True)


def _functions_in(node: ast.AST, where: str, prefix: str) -> list[tuple[int, str]]:
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = child.end_lineno - child.lineno + 1
            found.append((length, f"{where}:{child.lineno} {prefix}{child.name}"))
            found.extend(_functions_in(child, where, f"{prefix}{child.name}."))
        elif isinstance(child, ast.ClassDef):
            found.extend(_functions_in(child, where, f"{prefix}{child.name}."))
        else:
            found.extend(_functions_in(child, where, prefix))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--top", type=int, default=10, help="how many of the longest functions to list")
    args = parser.parse_args()
    counts = lines_per_package(args.root)
    print("| package | lines |\n|---|---|")
    for name, count in counts.items():
        if count:
            print(f"| {name} | {count:,} |")
    product = sum(count for name, count in counts.items() if name.split("/")[0] in PRODUCT)
    print(f"| product code ({', '.join(PRODUCT)}) | {product:,} |")
    modules = oversized_modules(args.root)
    print(f"\n{len(modules)} product modules over {MODULE_LIMIT} lines")
    for length, where in modules:
        print(f"  {length:5d}  {where}")
    every = functions(args.root)
    over = [item for item in every if item[0] > FUNCTION_LIMIT]
    print(f"\n{len(over)} product functions over {FUNCTION_LIMIT} lines; the {args.top} longest:")
    for length, where in every[: max(args.top, len(over))]:
        print(f"  {length:5d}  {where}")


if __name__ == "__main__":
    main()
