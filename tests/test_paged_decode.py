"""The C++ paged decode kernel against a float64 gather-and-softmax reference, its input checks, and its
fallback when it cannot be built."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torch.nn.functional as F

from shared.engine.model import paged_decode
from shared.engine.model.paged_decode import paged_decode_attention, paged_decode_available

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not paged_decode_available(),
    reason="paged decode kernel could not be built here (no C++ compiler or ninja; see the logged warning)",
)


def reference(query, key_cache, value_cache, block_table, context_lens, scale, sliding_window=None):
    """Gather each sequence's tokens and run softmax attention in float64, one head at a time (over the
    last sliding_window tokens only, when given)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for b in range(num_seqs):
        n = int(context_lens[b])
        blocks = block_table[b, : -(-n // block_size)].long()
        keys = key_cache[blocks].double().reshape(-1, num_kv_heads, head_dim)[:n]
        values = value_cache[blocks].double().reshape(-1, num_kv_heads, head_dim)[:n]
        if sliding_window is not None:
            keys, values = keys[max(0, n - sliding_window):], values[max(0, n - sliding_window):]
        for h in range(num_heads):
            weights = torch.softmax(keys[:, h // group] @ query[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values[:, h // group]
    return out


def random_case(seed, *, num_seqs, num_heads, num_kv_heads, head_dim, block_size, contexts, dtype=torch.float32,
                index_dtype=torch.int64, extra_blocks=5):
    """Caches with more blocks than needed, each sequence's blocks scattered in random order."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in contexts)
    num_blocks = num_seqs * width + extra_blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].view(num_seqs, width).to(index_dtype)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(contexts, dtype=torch.int64)
    return query, key_cache, value_cache, block_table, context_lens


def assert_matches(args, scale, atol=1e-5):
    out = paged_decode_attention(*args, scale)
    expected = reference(*args, scale)
    assert out.shape == expected.shape and out.dtype == args[0].dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (12, 4)])
def test_matches_reference_across_gqa_ratios_and_head_dims(head_dim, num_heads, num_kv_heads):
    # Contexts: 1 token, exactly one block, block multiples and ragged ends.
    contexts = [1, 16, 17, 33, 64, 100, 127, 160]
    args = random_case(head_dim + num_heads, num_seqs=len(contexts), num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, contexts=contexts)
    assert_matches(args, head_dim ** -0.5)


@pytest.mark.parametrize("num_seqs", [1, 3, 64])
def test_matches_reference_whether_tasks_split_heads_or_not(num_seqs):
    # Few sequences split each one's kv heads across tasks; many give each task a whole sequence.
    gen = torch.Generator().manual_seed(num_seqs)
    contexts = torch.randint(1, 200, (num_seqs,), generator=gen).tolist()
    args = random_case(num_seqs, num_seqs=num_seqs, num_heads=12, num_kv_heads=4, head_dim=64, block_size=16,
                       contexts=contexts)
    assert_matches(args, 0.125)


def test_shared_blocks_and_padded_table():
    # Two sequences share a prefix block; rows are padded with block 0 past their context.
    query, key_cache, value_cache, _, _ = random_case(7, num_seqs=3, num_heads=6, num_kv_heads=2, head_dim=64,
                                                      block_size=16, contexts=[40, 40, 40])
    block_table = torch.tensor([[5, 2, 0, 0], [5, 7, 1, 0], [3, 0, 0, 0]])
    context_lens = torch.tensor([20, 45, 9])
    assert_matches((query, key_cache, value_cache, block_table, context_lens), 0.125)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes_other_than_16(block_size):
    args = random_case(block_size, num_seqs=4, num_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size,
                       contexts=[1, 31, 50, 77])
    assert_matches(args, 0.125)


# A hang inside the kernel never returns to Python, so only the thread method can end the test.
@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [2, 6, 8, 12, 14, 24, 36])
def test_small_and_odd_head_sizes_end_and_match(head_dim, dtype):
    # head_dim x element size under 64 bytes (a cache line) used to make the kernel loop forever; one kv
    # head per task is the worst case (the prefetched span is one head's row).
    for num_seqs in (1, 6):
        args = random_case(head_dim, num_seqs=num_seqs, num_heads=4, num_kv_heads=1, head_dim=head_dim,
                           block_size=8, contexts=[1, 7, 8, 9, 30, 41][:num_seqs], dtype=dtype)
        assert_matches(args, head_dim ** -0.5, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [12, 64, 128])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33, 500])
def test_sliding_window_sees_only_the_last_keys(sliding_window, head_dim, dtype):
    contexts = [1, 5, 16, 17, 40, 100]
    args = random_case(sliding_window + head_dim, num_seqs=len(contexts), num_heads=8, num_kv_heads=2,
                       head_dim=head_dim, block_size=16, contexts=contexts, dtype=dtype)
    out = paged_decode_attention(*args, head_dim ** -0.5, sliding_window)
    expected = reference(*args, head_dim ** -0.5, sliding_window)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)
    if sliding_window < max(contexts):
        assert not torch.allclose(out.double(), reference(*args, head_dim ** -0.5), atol=atol, rtol=atol)


def test_rejects_a_window_under_one():
    args = random_case(1, num_seqs=1, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, contexts=[4])
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_decode_attention(*args, 0.25, 0)


@pytest.mark.parametrize("head_dim", [40, 80])
def test_head_dims_without_a_specialised_kernel(head_dim):
    # 80 is a multiple of 16 (vector path), 40 is not (scalar tail).
    args = random_case(head_dim, num_seqs=3, num_heads=6, num_kv_heads=3, head_dim=head_dim, block_size=16,
                       contexts=[5, 30, 90])
    assert_matches(args, head_dim ** -0.5)


def test_int32_block_table_and_int32_context_lens():
    query, key_cache, value_cache, table, lens = random_case(3, num_seqs=5, num_heads=8, num_kv_heads=4, head_dim=64,
                                                             block_size=16, contexts=[3, 19, 48, 70, 96],
                                                             index_dtype=torch.int32)
    expected = reference(query, key_cache, value_cache, table, lens, 0.125)
    out = paged_decode_attention(query, key_cache, value_cache, table, lens.int(), 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_strided_query_view_and_cache_view_of_a_larger_pool():
    # The model's query is a slice of the fused qkv output; a cache may be one layer of a stacked pool.
    gen = torch.Generator().manual_seed(11)
    num_seqs, num_heads, num_kv_heads, head_dim, block_size = 4, 12, 4, 64, 16
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    pool = torch.randn(2, 2, 40, block_size, num_kv_heads, head_dim, generator=gen)
    key_cache, value_cache = pool[1, 0], pool[1, 1]
    block_table = torch.randperm(40, generator=gen)[:24].view(num_seqs, 6)
    context_lens = torch.tensor([96, 1, 50, 81])
    assert not query.is_contiguous()
    assert_matches((query, key_cache, value_cache, block_table, context_lens), 0.125)


def test_bfloat16_accumulates_in_float32():
    args = random_case(5, num_seqs=6, num_heads=12, num_kv_heads=4, head_dim=64, block_size=16,
                       contexts=[1, 15, 16, 60, 128, 190], dtype=torch.bfloat16)
    # The reference sees the same bfloat16 inputs; only the output's rounding to bfloat16 differs.
    assert_matches(args, 0.125, atol=1e-2)


def test_matches_the_gather_and_sdpa_path_it_replaces():
    """The decode path the kernel replaces: whole blocks gathered, keys past the context masked."""
    num_seqs, block_size = 8, 16
    contexts = [1, 17, 40, 64, 100, 128, 150, 192]
    query, key_cache, value_cache, table, lens = random_case(13, num_seqs=num_seqs, num_heads=12, num_kv_heads=4,
                                                             head_dim=64, block_size=block_size, contexts=contexts)
    invalid = torch.arange(table.shape[1] * block_size).unsqueeze(0) >= lens.unsqueeze(1)
    mask = torch.zeros(invalid.shape).masked_fill_(invalid, float("-inf")).view(num_seqs, 1, 1, -1)
    keys = key_cache.index_select(0, table.flatten()).view(num_seqs, -1, 4, 64)
    values = value_cache.index_select(0, table.flatten()).view(num_seqs, -1, 4, 64)
    sdpa = F.scaled_dot_product_attention(query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=mask, scale=0.125, enable_gqa=True).view(num_seqs, 12, 64)
    out = paged_decode_attention(query, key_cache, value_cache, table, lens, 0.125)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    query, key_cache, value_cache, _, _ = random_case(1, num_seqs=1, num_heads=4, num_kv_heads=2, head_dim=64,
                                                      block_size=16, contexts=[16])
    out = paged_decode_attention(query[:0], key_cache, value_cache, torch.zeros(0, 1, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), 0.125)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(block_table=a["block_table"].clone().fill_(99)), "outside the cache"),
    (lambda a: a.update(context_lens=torch.tensor([0, 5])), "outside \\[1"),
    (lambda a: a.update(context_lens=torch.tensor([33, 5])), "outside \\[1"),
    (lambda a: a.update(query=a["query"].double()), "float32 and bfloat16"),
    (lambda a: a.update(key_cache=a["key_cache"].bfloat16()), "share one dtype"),
    (lambda a: a.update(query=a["query"][:, :3]), "multiple of kv heads"),
    (lambda a: a.update(block_table=a["block_table"].float()), "int64 or int32"),
    (lambda a: a.update(context_lens=torch.tensor([5])), "context_lens must have shape"),
])
def test_rejects_malformed_input(change, message):
    query, key_cache, value_cache, table, lens = random_case(2, num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64,
                                                             block_size=16, contexts=[20, 5], extra_blocks=0)
    args = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=table, context_lens=lens)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, scale=0.125)


def test_availability_by_dtype_and_device():
    assert paged_decode_available(torch.float32) and paged_decode_available(torch.bfloat16, "cpu")
    assert not paged_decode_available(torch.float16)
    assert not paged_decode_available(torch.float32, "cuda")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to list loaded libraries")
def test_uses_the_openmp_runtime_torch_already_loaded():
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line or "libomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_an_unloadable_kernel_falls_back_with_one_warning(monkeypatch, caplog):
    """In process: whatever stops the load is logged once and cached; attention then refuses to run."""
    def fail_to_load():
        raise OSError("no compiler here")

    monkeypatch.setattr(paged_decode.kernel_build, "load_library", fail_to_load)
    # A fresh cache around the same loader; monkeypatch puts the loaded kernel's cache back afterwards.
    monkeypatch.setattr(paged_decode, "_kernel", functools.cache(paged_decode._kernel.__wrapped__))
    assert paged_decode.paged_decode_available() is False
    assert paged_decode.paged_decode_available() is False  # the failure is cached, not retried
    assert [r.getMessage() for r in caplog.records].count(
        "paged decode kernel unavailable, decode attention keeps the SDPA path: no compiler here") == 1
    with pytest.raises(RuntimeError, match="paged decode kernel unavailable"):
        paged_decode_attention(torch.zeros(1, 1, 16), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16),
                               torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)


@pytest.mark.e2e  # starts a Python process
def test_build_failure_falls_back_with_a_warning(tmp_path):
    """A fresh build folder and a compiler that does not exist: available is False, nothing raises."""
    script = textwrap.dedent("""
        import logging
        import torch
        from shared.engine.model.paged_decode import paged_decode_attention, paged_decode_available
        logging.basicConfig(level=logging.WARNING)
        assert paged_decode_available() is False
        assert paged_decode_available() is False  # the failure is cached, not retried
        try:
            paged_decode_attention(torch.zeros(1, 1, 16), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16),
                                   torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)
        except RuntimeError as exc:
            print("raised:", exc)
    """)
    env = dict(os.environ, PDSERVE_KERNEL_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("paged decode kernel unavailable") == 1, result.stderr
    assert "raised: paged decode kernel unavailable" in result.stdout
