"""Fixtures shared across test modules."""
from __future__ import annotations

import os

import pytest
import torch

# Triton decides at kernel definition (import) time whether to interpret: without a GPU its kernels
# run in the interpreter on CPU tensors. Set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def split_cluster(tmp_path_factory):
    """One split system for every module that needs it (starting one takes seconds on 2 cores). Tests
    using it leave it idle: every request ends and every block is free again."""
    from split_cluster import start_split_cluster  # the unit lane does not load the launcher

    with start_split_cluster(tmp_path_factory.mktemp("split-cluster-logs")) as running:
        yield running
