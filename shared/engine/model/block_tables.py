"""The KV block ids of every request the runner knows, one row each of a host int64 array kept across
steps. A step's decode block table is then one gather of rows and its slot mapping one vectorised
expression, instead of tensors built from Python lists every step (at batch 128 with 1,024-token
contexts that cost about 0.5 ms of host time a step, which a GPU step cannot hide).

Columns past a row's blocks hold 0: the reserved block nobody's table uses, which the kernels read
only for padding.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, initial_rows: int = 16, initial_cols: int = 64):
        self._table = np.zeros((initial_rows, initial_cols), dtype=np.int64)
        self._num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A new request's row."""
        if not self._free_rows:
            self._grow(rows=2 * len(self._num_blocks))
        row = self._free_rows.pop()
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        start = int(self._num_blocks[row])
        end = start + len(block_ids)
        if end > self._table.shape[1]:
            self._grow(cols=max(end, 2 * self._table.shape[1]))
        self._table[row, start:end] = block_ids
        self._num_blocks[row] = end

    def free(self, row: int) -> None:
        self._table[row, :self._num_blocks[row]] = 0
        self._num_blocks[row] = 0
        self._free_rows.append(row)

    def num_blocks(self, row: int) -> int:
        return int(self._num_blocks[row])

    def blocks(self, row: int, count: int) -> np.ndarray:
        """The row's first count block ids."""
        return self._table[row, :count]

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """[len(rows), width]: each row's first width block ids, 0 past its blocks."""
        if width > self._table.shape[1]:
            self._grow(cols=width)
        return self._table[rows, :width]

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The cache slot of each (row, token position) pair."""
        return self._table[rows, positions // block_size] * block_size + positions % block_size

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self._table.shape
        rows, cols = rows or old_rows, cols or old_cols
        table = np.zeros((rows, cols), dtype=np.int64)
        table[:old_rows, :old_cols] = self._table
        self._table = table
        self._num_blocks = np.concatenate([self._num_blocks, np.zeros(rows - old_rows, dtype=np.int64)])
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)
