"""KV handoff bandwidth, pull (READ) against push (WRITE), between two processes over NIXL.

A "prefill" and a "decode" process each register a KV pool shaped like Llama-3.1-8B's in bf16
(32 layers x K,V = 64 tensors, 8 KV heads x 128 x 2 bytes = 2 KiB per token per tensor, 16-token
blocks: 128 KiB per token over all layers), on the CPU (NIXL DRAM, UCX cma) or one GPU (VRAM, UCX
cuda_ipc; both processes on the same device). Each case moves one prompt's blocks, one contiguous
run per tensor (64 descriptors), four ways: decode READs them from prefill (the pull pdserve uses),
prefill WRITEs them into decode (a push), each with and without a NIXL notification. A first case
moves 64 MiB as one descriptor between single-tensor pools (the transport's raw rate).

Each timing runs from posting the transfer to the initiator seeing it DONE (for a notified one,
that includes the notification going out, which waits for the peer's next progress call: the peer
spins on get_notifs() while the other side transfers). Repeats rotate through pools twice the
largest case, so no repeat re-reads blocks the last one left in a cache. The first transfer of
each case and way is a warm-up, after which the destination's bytes are checked against the source
(a digest of the blocks on each side). Figures: median and best GB/s (1e9 bytes/s).

    python -m benchmarks.bench_kv_push_pull --device cuda --json kv.json
    python -m benchmarks.bench_kv_push_pull --device cpu --tokens 16 64 --layers 2 --repeats 3   (small)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

# Llama-3.1-8B's KV in bf16, and pdserve's block size.
LAYERS_8B = 32
KV_HEADS_8B = 8
HEAD_DIM_8B = 128
BF16_BYTES = 2
BLOCK_TOKENS = 16
HANDOFF_TOKENS = (128, 512, 1024, 2048, 4096)
RAW_BYTES = 64 << 20  # the raw case: one 64 MiB descriptor
RAW_BLOCK_BYTES = 1 << 20
WAYS = (("READ", False), ("READ", True), ("WRITE", False), ("WRITE", True))
# The bar for the pull on an H200: the raw 64 MiB READ, median.
TARGET_READ_64MIB_GB_PER_S = 100.0
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PoolShape:
    """One side's KV pool: num_tensors tensors of [num_blocks, block_bytes] bytes."""

    num_tensors: int
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int | None  # None for the raw case
    num_blocks: int  # per transfer, contiguous


def _handoff_shape(layers: int, max_tokens: int) -> PoolShape:
    block_bytes = BLOCK_TOKENS * KV_HEADS_8B * HEAD_DIM_8B * BF16_BYTES  # 32 KiB per tensor per block
    max_blocks = -(-max_tokens // BLOCK_TOKENS)
    return PoolShape(2 * layers, block_bytes, 2 * max_blocks)


def _raw_shape() -> PoolShape:
    return PoolShape(1, RAW_BLOCK_BYTES, 2 * RAW_BYTES // RAW_BLOCK_BYTES)


def _block_ids(case: Case, shape: PoolShape, repeat: int) -> list[int]:
    """Contiguous ids for one repeat; consecutive repeats alternate between the pool's halves."""
    start = (repeat * case.num_blocks) % shape.num_blocks
    if start + case.num_blocks > shape.num_blocks:
        start = 0
    return list(range(start, start + case.num_blocks))


# ---- the two processes ---------------------------------------------------------------------------
def _side_main(conn, role: str, device: str, shape: PoolShape) -> None:
    """One side: a pool with its own byte pattern and an agent, driven by the parent's commands."""
    import torch

    from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    seed = 1 if role == "prefill" else 2  # different bytes on each side, so a missing copy shows
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = [
        torch.randint(0, 256, (shape.num_blocks, shape.block_bytes), generator=generator, device=device,
                      dtype=torch.uint8)
        for _ in range(shape.num_tensors)
    ]
    nixl_module = None
    with KvTransferAgent(KvTransferAgent.unique_name(f"bench-{role}")) as agent:
        source = agent.register_kv_caches(tensors)
        nixl_module = next((name for name in ("nixl_cu13", "nixl_cu12") if name in sys.modules), None)
        conn.send((source, nixl_module))
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            conn.send(_COMMANDS[command](agent, tensors, conn, *args))


def _add_peer(agent, tensors, conn, source) -> None:
    agent.add_peer(source)


def _serve(agent, tensors, conn) -> int:
    """Spin on get_notifs() (UCX advances only inside agent calls) until told to stop; notifs seen."""
    num_notifs = 0
    while not conn.poll(0):
        num_notifs += sum(len(messages) for messages in agent.get_notifs().values())
    conn.recv()  # "stop_serving"
    return num_notifs + sum(len(messages) for messages in agent.get_notifs().values())


def _transfer(agent, tensors, conn, op: str, peer_name: str, runs: list[tuple[list[int], list[int]]],
              notif: bool) -> list[float]:
    """Post each (local ids, remote ids) transfer in turn and time it to DONE; seconds per transfer."""
    from shared.engine.kv_transfer.transfer import TransferState

    seconds = []
    for local_ids, remote_ids in runs:
        start = time.perf_counter()
        if op == "READ":
            transfer = agent.read_blocks(peer_name, remote_ids, local_ids, notif_msg=b"bench" if notif else None)
        else:
            transfer = agent.write_blocks(peer_name, local_ids, remote_ids, notif_msg=b"bench" if notif else None)
        state = agent.wait(transfer, TIMEOUT_S)
        seconds.append(time.perf_counter() - start)
        if state is not TransferState.DONE:
            raise RuntimeError(f"{op} ended {state.value}: {transfer.error}")
        agent.release(transfer)
    return seconds


def _digest(agent, tensors, conn, block_ids: list[int]) -> int:
    """A sum over the blocks' bytes in every tensor, position-weighted so swapped blocks differ too."""
    import torch

    total = 0
    for tensor_index, tensor in enumerate(tensors):
        blocks = tensor[block_ids].to(torch.int64)
        weights = torch.arange(1, blocks.numel() + 1, device=blocks.device, dtype=torch.int64).view_as(blocks)
        total += int((blocks * weights).sum().item()) * (tensor_index + 1)
    return total


def _scramble(agent, tensors, conn, block_ids: list[int]) -> None:
    """Overwrite blocks with a value neither pattern has at every byte, before a checked copy."""
    for tensor in tensors:
        tensor[block_ids] = 7
    if tensors[0].is_cuda:
        import torch

        torch.cuda.synchronize()


_COMMANDS = {"add_peer": _add_peer, "serve": _serve, "transfer": _transfer, "digest": _digest,
             "scramble": _scramble}


class _Side:
    def __init__(self, context, role: str, device: str, shape: PoolShape):
        self.role = role
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_side_main, args=(child_conn, role, device, shape), daemon=True)
        self.process.start()
        if not self.conn.poll(180):
            raise RuntimeError(f"the {role} process did not register its pool")
        self.source, self.nixl_module = self.conn.recv()

    def call(self, command: str, *args):
        self.conn.send((command, *args))
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop",))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


# ---- one pair of processes -----------------------------------------------------------------------
def _measure_way(prefill: _Side, decode: _Side, shape: PoolShape, case: Case, op: str, notif: bool,
                 repeats: int) -> dict:
    # READ: decode pulls prefill's blocks. WRITE: prefill pushes its blocks into decode's.
    initiator, target = (decode, prefill) if op == "READ" else (prefill, decode)
    runs = [(_block_ids(case, shape, r), _block_ids(case, shape, r)) for r in range(repeats + 1)]

    def timed(batch):
        target.conn.send(("serve",))
        seconds = initiator.call("transfer", op, target.source.agent_name, batch, notif)
        target.conn.send(("stop_serving",))
        num_notifs = target.conn.recv()
        if num_notifs != (len(batch) if notif else 0):
            raise RuntimeError(f"{case.name} {op}: {num_notifs} notifications for {len(batch)} transfers")
        return seconds

    first_ids = runs[0][0]  # the same ids on both sides
    # Prefill's blocks are the source either way; decode's differ from them before the checked copy.
    decode.call("scramble", first_ids)
    timed(runs[:1])  # warm-up: connection, IPC handle opening, first touch
    if decode.call("digest", first_ids) != prefill.call("digest", first_ids):
        raise RuntimeError(f"{case.name} {op}: the destination's bytes differ from the source's")
    seconds = timed(runs[1:])
    num_bytes = case.num_blocks * shape.block_bytes * shape.num_tensors
    return {
        "median_gb_per_s": num_bytes / statistics.median(seconds) / 1e9,
        "best_gb_per_s": num_bytes / min(seconds) / 1e9,
        "median_ms": statistics.median(seconds) * 1e3,
        "seconds": seconds,
    }


def _run_pair(device: str, shape: PoolShape, cases: list[Case], repeats: int,
              on_row: Callable[[dict, str | None], None]) -> None:
    """Start a prefill and a decode process with pools of this shape and measure each case; each
    row goes to on_row(row, the NIXL module the processes imported) as soon as it is measured."""
    context = multiprocessing.get_context("spawn")
    prefill = decode = None
    try:
        prefill = _Side(context, "prefill", device, shape)
        decode = _Side(context, "decode", device, shape)
        decode.call("add_peer", prefill.source)
        prefill.call("add_peer", decode.source)
        for case in cases:
            row = {
                "case": case.name,
                "tokens": case.tokens,
                "num_bytes": case.num_blocks * shape.block_bytes * shape.num_tensors,
                "num_descriptors": shape.num_tensors,  # one contiguous run per tensor
            }
            for op, notif in WAYS:
                key = op.lower() + ("_notif" if notif else "")
                row[key] = _measure_way(prefill, decode, shape, case, op, notif, repeats)
            on_row(row, prefill.nixl_module)
    finally:
        for side in (decode, prefill):
            if side is not None:
                side.stop()


# ---- report --------------------------------------------------------------------------------------
def _print_table(report: dict) -> None:
    print(f"\nKV handoff over NIXL, {report['device']} ({report['nixl_module']}), {report['repeats']} repeats; "
          f"GB/s median (best)")
    header = f"{'case':<24}{'MiB':>7}{'descs':>6}"
    for title in ("READ", "READ+notif", "WRITE", "WRITE+notif"):
        header += f"{title:>18}"
    print(header)
    for row in report["rows"]:
        line = f"{row['case']:<24}{row['num_bytes'] / 2**20:>7.1f}{row['num_descriptors']:>6}"
        for key in ("read", "read_notif", "write", "write_notif"):
            line += f"{row[key]['median_gb_per_s']:>10.2f} ({row[key]['best_gb_per_s']:>5.1f})"
        print(line)
    target = report.get("target")
    if target:
        print(f"raw 64 MiB READ median {target['read_64mib_median_gb_per_s']:.1f} GB/s; "
              f"target {target['min_gb_per_s']:.0f} GB/s: {'met' if target['met'] else 'NOT met'}")


def run(device: str, tokens: list[int], layers: int, repeats: int, raw: bool,
        save: Callable[[dict], None] = lambda report: None) -> dict:
    """Measure the raw case (the target's) first, then the handoff sizes; save(report) after each
    row, so a run cut short by a time limit still leaves what it measured."""
    from shared.engine.kv_transfer.nixl_loading import recommended_environment

    # Children inherit the environment at spawn, before they import torch or create an agent.
    os.environ.update(recommended_environment(uses_cuda=device == "cuda"))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    shape = _handoff_shape(layers, max(tokens))
    report = {
        "device": device,
        "nixl_module": None,
        "repeats": repeats,
        "layers": layers,
        "bytes_per_token": shape.num_tensors * shape.block_bytes // BLOCK_TOKENS,
        "environment": {name: value for name, value in os.environ.items() if name.startswith(("UCX_", "NIXL_"))},
        "rows": [],
    }

    def add_row(row: dict, nixl_module: str | None) -> None:
        report["nixl_module"] = nixl_module
        report["rows"].append(row)
        if row["tokens"] is None:
            median = row["read"]["median_gb_per_s"]
            report["target"] = {"read_64mib_median_gb_per_s": median, "min_gb_per_s": TARGET_READ_64MIB_GB_PER_S,
                                "met": median >= TARGET_READ_64MIB_GB_PER_S}
        save(report)

    if raw:
        _run_pair(device, _raw_shape(), [Case("raw 64 MiB", None, RAW_BYTES // RAW_BLOCK_BYTES)], repeats, add_row)
    cases = [Case(f"{count} tokens", count, -(-count // BLOCK_TOKENS)) for count in tokens]
    _run_pair(device, shape, cases, repeats, add_row)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(HANDOFF_TOKENS),
                        help="prompt lengths whose KV is handed off (one case each)")
    parser.add_argument("--layers", type=int, default=LAYERS_8B, help="fewer for a small run; 8B has 32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-raw", action="store_true", help="skip the raw 64 MiB case")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.layers < 1 or min(args.tokens) < 1:
        parser.error("--repeats, --layers and --tokens must be positive")
    def save(report: dict) -> None:
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=2)

    report = run(args.device, args.tokens, args.layers, args.repeats, raw=not args.no_raw, save=save)
    _print_table(report)
    return report


if __name__ == "__main__":
    main()
