"""Fixtures shared across test modules, and the fast lane's collection shortcut."""
from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import pytest
import torch

# Triton decides at kernel definition (import) time whether to interpret: without a GPU its kernels
# run in the interpreter on CPU tensors. Set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A module-level `pytestmark = pytest.mark.e2e` (or a list holding it) on one line: every test in the module
# is e2e.
_E2E_MODULE = re.compile(r"^pytestmark = .*\bpytest\.mark\.e2e\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that deselects every e2e test (the fast lane, -m "not e2e") does not import the modules that
    are e2e as a whole: pytest would import them only to deselect all their tests, and their imports
    (hypothesis, openai, the launcher...) cost the fast lane seconds. Any other run collects as usual."""
    if not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    if not _deselects_every_e2e_test(config.option.markexpr):
        return None
    return True if _E2E_MODULE.search(collection_path.read_text()) else None


def pytest_configure(config: pytest.Config) -> None:
    """The garbage collector, at its default of a pass every 700 allocations, took about a fifth of the fast
    lane: passes come less often.

    The fast lane runs no hypothesis test (they are e2e), but hypothesis' pytest plugin imports all of
    hypothesis at the end of every session (its terminal summary), a second or more of the lane's time."""
    gc.set_threshold(10_000, 50, 50)
    if _deselects_every_e2e_test(config.option.markexpr):
        plugin = config.pluginmanager.get_plugin("hypothesispytest")
        if plugin is not None:
            config.pluginmanager.unregister(plugin)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection built (torch, transformers, every test module) moves out of the
    garbage collector's view: its older passes otherwise walk that heap again and again (see
    pytest_configure)."""
    gc.collect()
    gc.freeze()


def _deselects_every_e2e_test(markexpr: str) -> bool:
    """Whether the -m expression is terms joined by "and", one of them "not e2e". Expressions with "or" or
    parentheses are left to pytest's own deselection."""
    if not markexpr or re.search(r"\bor\b|[()]", markexpr):
        return False
    return any(term.split() == ["not", "e2e"] for term in re.split(r"\band\b", markexpr))


@pytest.fixture(scope="session")
def split_cluster(tmp_path_factory):
    """One split system for every module that needs it (starting one takes seconds on 2 cores). Tests
    using it leave it idle: every request ends and every block is free again."""
    from split_cluster import start_split_cluster  # the unit lane does not load the launcher

    with start_split_cluster(tmp_path_factory.mktemp("split-cluster-logs")) as running:
        yield running
