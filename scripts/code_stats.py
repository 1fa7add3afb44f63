"""Code-size figures for the closing notes: lines of Python per top-level package (and per
sub-package of shared/), and the longest functions. Run from a repo root:
    python scripts/code_stats.py [--top 10]
"""
from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

PACKAGES = ("shared", "prefill_svc", "decode_svc", "colocated_svc", "router", "pdserve", "benchmarks", "tests")


def python_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "_pb2" not in p.name)


def lines_per_package(root: Path) -> dict[str, int]:
    counts: dict[str, int] = collections.Counter()
    for package in PACKAGES:
        for path in python_files(root, package):
            parts = path.relative_to(root).parts
            # shared/ is reported per folder (shared/engine/sched, shared/serving, ...), the rest per package.
            key = "/".join(parts[:-1][:3]) if package == "shared" else package
            counts[key] += len(path.read_text().splitlines())
    return dict(sorted(counts.items()))


def longest_functions(root: Path, top: int) -> list[tuple[int, str]]:
    found = []
    for package in PACKAGES:
        if package in ("tests", "benchmarks"):
            continue
        for path in python_files(root, package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    found.append((length, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    print("| package | lines |\n|---|---|")
    for name, count in lines_per_package(args.root).items():
        if not count:
            continue
        print(f"| {name} | {count} |")
    print(f"\n| longest functions (lines) | where |\n|---|---|")
    for length, where in longest_functions(args.root, args.top):
        print(f"| {length} | {where} |")


if __name__ == "__main__":
    main()
