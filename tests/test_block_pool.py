"""Block pool: null block, ref counts, LRU free queue with lazy eviction, and block hashing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.kv_cache.block_pool import BlockPool
from shared.engine.kv_cache.hashing import hash_block, hash_block_tokens, root_hash


def test_null_block_is_reserved():
    pool = BlockPool(num_blocks=4)
    assert pool.get_num_free_blocks() == 3
    blocks = pool.get_new_blocks(3)
    assert 0 not in [b.block_id for b in blocks]
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


def test_ref_counts_share_and_free():
    pool = BlockPool(num_blocks=5)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert pool.get_num_free_blocks() == 3  # b is back, a still shared
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_free_queue_is_lru_in_given_order():
    pool = BlockPool(num_blocks=6)
    blocks = pool.get_new_blocks(5)
    # Free in "eviction order": the ones given first are handed out first.
    pool.free_blocks([blocks[3], blocks[1]])
    pool.free_blocks([blocks[4], blocks[0], blocks[2]])
    assert pool.free_block_ids() == [blocks[i].block_id for i in (3, 1, 4, 0, 2)]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [blocks[3].block_id, blocks[1].block_id]


def test_cached_blocks_are_evicted_lazily():
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    ha, hb = hash_block(root_hash(), [1, 2]), hash_block(root_hash(), [3, 4])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a, b, c])
    # Free but still cached: a prefix hit can revive them.
    assert pool.get_cached_block(ha) is a and pool.get_cached_block(hb) is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    # Handing out a free cached block evicts its hash at that moment (not before).
    (first,) = pool.get_new_blocks(1)
    assert first is a
    assert pool.get_cached_block(ha) is None and a.block_hash is None
    assert pool.get_cached_block(hb) is b
    assert pool.num_evictions == 1


def test_first_writer_wins_for_equal_content():
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    h = hash_block(root_hash(), [7] * 4)
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # b: uncached, nothing to evict
    assert pool.get_cached_block(h) is a


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(num_blocks=4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, hash_block(root_hash(), [1]))
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 1
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and a.block_hash is None


def test_hash_chaining():
    root = root_hash()
    h1 = hash_block(root, [1, 2, 3, 4])
    h2 = hash_block(h1, [5, 6, 7, 8])
    # The same block content under a different parent is a different block.
    assert hash_block(root, [5, 6, 7, 8]) != h2
    assert hash_block_tokens(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h1, h2]
    # Extra keys, the seed and token values all matter; the encoding is unambiguous.
    assert hash_block(root, [1, 2, 3, 4], ["mm:x:0"]) != h1
    assert root_hash("other") != root
    assert hash_block(root, [1, 2, 3, 5]) != h1
    assert hash_block(root, [1 << 40]) != hash_block(root, [0, 256])
    assert len(h1) == 32


@pytest.mark.e2e
def test_hashes_are_identical_across_processes():
    # Prefill and decode pods must agree: no per-process salt (Python's hash() would differ).
    code = (
        "from shared.engine.kv_cache.hashing import hash_block_tokens, root_hash;"
        "print(hash_block_tokens(root_hash('s'), list(range(64)), 16)[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            timeout=60,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    assert outputs == {hash_block_tokens(root_hash("s"), list(range(64)), 16)[-1].hex()}
