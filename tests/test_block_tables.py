"""BlockTables: the runner's host block table, kept across steps."""
import numpy as np

from shared.engine.model.block_tables import BlockTables


def test_rows_gather_with_zero_padding_past_each_requests_blocks():
    tables = BlockTables(initial_rows=2, initial_cols=2)
    a = tables.add([7, 8, 9])  # wider than the initial columns
    b = tables.add([4])
    tables.extend(b, [5])
    assert tables.num_blocks(a) == 3 and tables.num_blocks(b) == 2
    np.testing.assert_array_equal(tables.gather([b, a], 4), [[4, 5, 0, 0], [7, 8, 9, 0]])
    np.testing.assert_array_equal(tables.gather([a], 2), [[7, 8]])
    np.testing.assert_array_equal(tables.blocks(a, 2), [7, 8])


def test_rows_grow_past_the_initial_count_and_freed_rows_come_back_empty():
    tables = BlockTables(initial_rows=1, initial_cols=4)
    rows = [tables.add([10 * i + 1, 10 * i + 2]) for i in range(5)]
    assert sorted(rows) == list(range(5))
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(tables.blocks(row, 2), [10 * i + 1, 10 * i + 2])
    tables.free(rows[2])
    again = tables.add([99])
    assert again == rows[2]
    np.testing.assert_array_equal(tables.gather([again], 3), [[99, 0, 0]])  # nothing of the freed request
    assert tables.num_blocks(again) == 1


def test_slots_map_positions_through_each_rows_blocks():
    tables = BlockTables()
    a = tables.add([3, 6])
    b = tables.add([2])
    rows = np.array([a, a, a, b])
    positions = np.array([0, 3, 4, 1])
    # block_size 4: position p of a row is slot table[row, p // 4] * 4 + p % 4
    np.testing.assert_array_equal(tables.slots(rows, positions, 4), [12, 15, 24, 9])
