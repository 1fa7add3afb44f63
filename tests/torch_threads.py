"""One torch thread for transformers' reference runs on the parity tests' tiny models: their generate() is
per-op overhead, which a second thread only adds to (and on a busy machine multiplies, as each op waits
for both threads). The engine sets its own thread count per step, so this holds for the references only."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
