"""Decode attention per call on the 100m model's shapes: gather + SDPA (the current path) vs the paged kernel.

    python benchmarks/bench_decode_attention.py                 # float32, 2 threads
    python benchmarks/bench_decode_attention.py --dtype bfloat16 --threads 1

Each layer has its own cache and the calls cycle through the layers, as a decode step does, so each
call reads K and V that the previous call did not leave in the CPU cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.model.paged_decode import paged_decode_attention, paged_decode_available  # noqa: E402


def make_inputs(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    bs, kvh, d = args.block_size, args.kv_heads, args.head_dim
    lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), generator=gen)
    width = -(-args.max_context // bs)
    num_blocks = args.batch * width + 64
    # Blocks of a sequence are scattered over the pool, as after many allocations and frees.
    table = torch.randperm(num_blocks, generator=gen)[: args.batch * width].view(args.batch, width)
    caches = [(torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype),
               torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)) for _ in range(args.layers)]
    # The model's query is a strided view of the fused qkv projection.
    qkv = torch.randn(args.batch, (args.heads + 2 * kvh) * d, generator=gen).to(dtype)
    query = qkv[:, : args.heads * d].view(args.batch, args.heads, d)
    invalid = torch.arange(width * bs).unsqueeze(0) >= lens.unsqueeze(1)
    mask = torch.zeros(invalid.shape, dtype=dtype).masked_fill_(invalid, float("-inf")).view(args.batch, 1, 1, -1)
    return dict(query=query, caches=caches, table=table, lens=lens, mask=mask, scale=d ** -0.5)


def sdpa_path(query, key_cache, value_cache, table, mask, scale):
    """The current _decode_attention: gather whole blocks with index_select, then masked SDPA."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    flat = table.flatten()
    keys = key_cache.index_select(0, flat).view(num_seqs, -1, num_kv_heads, head_dim)
    values = value_cache.index_select(0, flat).view(num_seqs, -1, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.view(num_seqs, num_heads, head_dim)


def time_calls(fn, num_layers: int, calls: int, repeats: int) -> tuple[float, float]:
    """Median and best over repeats of the mean ms per call, each repeat cycling through the layers."""
    for layer in range(num_layers):
        fn(layer)
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i % num_layers)
        results.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(results), min(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-context", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=192)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=120, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    start = time.perf_counter()
    available = paged_decode_available(dtype)
    print(f"kernel available: {available} (load/compile {time.perf_counter() - start:.1f} s)")
    x = make_inputs(args, dtype)
    kv_bytes = int(x["lens"].sum()) * args.kv_heads * args.head_dim * x["query"].element_size() * 2
    print(f"shapes: batch {args.batch}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"contexts {args.min_context}..{args.max_context}, block {args.block_size}, {args.dtype}, "
          f"{args.threads} threads, {kv_bytes / 1e6:.1f} MB of K+V per call")

    def sdpa(layer: int) -> torch.Tensor:
        key_cache, value_cache = x["caches"][layer]
        return sdpa_path(x["query"], key_cache, value_cache, x["table"], x["mask"], x["scale"])

    def kernel(layer: int) -> torch.Tensor:
        key_cache, value_cache = x["caches"][layer]
        return paged_decode_attention(x["query"], key_cache, value_cache, x["table"], x["lens"], x["scale"])

    sdpa_ms, sdpa_best = time_calls(sdpa, args.layers, args.calls, args.repeats)
    print(f"gather + sdpa : {sdpa_ms:.3f} ms/call median (best {sdpa_best:.3f})")
    if not available:
        print("paged kernel  : unavailable (see warning above)")
        return
    kernel_ms, kernel_best = time_calls(kernel, args.layers, args.calls, args.repeats)
    print(f"paged kernel  : {kernel_ms:.3f} ms/call median (best {kernel_best:.3f}); "
          f"{sdpa_ms / kernel_ms:.1f}x faster, {kv_bytes / kernel_ms / 1e6:.1f} GB/s of K+V")
    diff = (sdpa(0).float() - kernel(0).float()).abs().max().item()
    print(f"max |sdpa - kernel| on layer 0: {diff:.2e}")


if __name__ == "__main__":
    main()
