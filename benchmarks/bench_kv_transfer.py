"""KV pull bandwidth over NIXL (UCX, loopback) between two processes, against a local torch memcpy.

A "prefill" process registers a KV pool and calls get_notifs() every --prefill-poll-ms; a "decode"
process reads blocks with KvTransferAgent.read_blocks, timed from the call to DONE, with and without
a notification. Each repeat moves different blocks (offsets rotate through 128 MiB pools, beyond the
L3 cache), and the memcpy baseline (tensor.copy_ between two local 128 MiB pools) rotates the same way;
--hot repeats the same blocks instead (cache-warm, both sides). memcpy and READ take turns within each
repeat; READ+notif is timed after them. Figures are medians and bests (max GB/s); READ/memcpy is the median of the
per-repeat ratios.
Run from the repo root: python -m benchmarks.bench_kv_transfer [--thp both|on|off] [--repeats N] [--hot]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from typing import Callable

BLOCK_BYTES = 16 * 1024
POOL_BLOCKS = 8192  # 128 MiB per pool
TIMEOUT_S = 30.0

# A case maps a repeat index to (remote block ids, local block ids); all blocks are 16 KiB.
Case = Callable[[int], tuple[list[int], list[int]]]


def _contiguous(num_blocks: int) -> Case:
    def blocks(repeat: int) -> tuple[list[int], list[int]]:
        start = (repeat * num_blocks) % POOL_BLOCKS
        ids = list(range(start, start + num_blocks))
        return ids, ids

    return blocks


def _scattered(repeat: int) -> tuple[list[int], list[int]]:
    # Every other remote block into every third local block: nothing coalesces, 1024 descriptors.
    remote_start = (repeat * 2048) % (POOL_BLOCKS - 2048)
    local_start = (repeat * 1024) % (POOL_BLOCKS - 3072)
    return (
        [remote_start + 2 * index for index in range(1024)],
        [local_start + 3 * index for index in range(1024)],
    )


def _runs(repeat: int) -> tuple[list[int], list[int]]:
    # The same 16 MiB as 64 runs of 16 blocks (256 KiB), contiguous on both sides within a run.
    remote_start = (repeat * 2048) % (POOL_BLOCKS - 2048)
    local_start = (repeat * 1024) % (POOL_BLOCKS - 3072)
    return (
        [remote_start + 32 * run + offset for run in range(64) for offset in range(16)],
        [local_start + 48 * run + offset for run in range(64) for offset in range(16)],
    )


CASES: list[tuple[str, Case]] = [
    ("4 MiB contiguous", _contiguous(256)),
    ("64 MiB contiguous", _contiguous(4096)),
    ("1024 x 16 KiB scattered", _scattered),
    ("64 runs x 256 KiB", _runs),
]


def _pattern(num_blocks: int):
    import torch

    values = torch.arange(num_blocks * BLOCK_BYTES, dtype=torch.int64).remainder_(251).to(torch.uint8)
    return values.view(num_blocks, BLOCK_BYTES)


def _huge_page_kib() -> int | None:
    try:
        with open("/proc/self/smaps_rollup") as smaps:
            for line in smaps:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _prefill_main(conn, poll_interval_s: float) -> None:
    import torch

    from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

    torch.set_num_threads(1)
    pool = torch.empty((POOL_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    pool.copy_(_pattern(POOL_BLOCKS))
    with KvTransferAgent(KvTransferAgent.unique_name("bench-prefill")) as agent:
        conn.send((agent.register_kv_caches([pool]), _huge_page_kib()))
        num_notifs = 0
        while True:
            num_notifs += sum(len(messages) for messages in agent.get_notifs().values())
            if conn.poll(poll_interval_s) and conn.recv() == "stop":
                break
        conn.send(num_notifs)


def _time_interleaved(runs: dict[str, Callable[[int], None]], repeats: int, hot: bool) -> dict[str, list[float]]:
    """Seconds of each run(repeat) per repeat, after one warm-up each. The runs take turns within
    every repeat, so each sees the same machine state (load, cache) as the others: on a small shared
    VM, timing one kind after the other measured the load swing, not the transfer."""
    for run in runs.values():
        run(0 if hot else repeats)  # warm-up: connection set-up, first-touch page faults
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run(0 if hot else repeat)
            samples[name].append(time.perf_counter() - start)
    return samples


def _decode_main(conn, repeats: int, hot: bool) -> None:
    import torch

    from shared.engine.kv_transfer.transfer import TransferState
    from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

    # One thread, as the READ itself (UCX copies in the calling thread): on 2 busy cores torch's
    # parallel copy_ mostly measures thread hand-off jitter.
    torch.set_num_threads(1)
    source = conn.recv()
    pool = torch.zeros((POOL_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    local_source = torch.ones((POOL_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    expected = _pattern(POOL_BLOCKS)
    results = []
    with KvTransferAgent(KvTransferAgent.unique_name("bench-decode")) as agent:
        agent.register_kv_caches([pool])
        agent.add_peer(source)
        for name, case in CASES:
            remote_ids, local_ids = case(0)
            num_bytes = len(remote_ids) * BLOCK_BYTES
            row = {"name": name, "num_bytes": num_bytes, "post": []}

            def pull(repeat: int, notif_msg: bytes | None) -> None:
                remote, local = case(repeat)
                start = time.perf_counter()
                transfer = agent.read_blocks(source.agent_name, remote, local, notif_msg=notif_msg)
                if notif_msg is None:
                    row["post"].append(time.perf_counter() - start)
                if agent.wait(transfer, TIMEOUT_S) is not TransferState.DONE:
                    raise RuntimeError(f"{name}: READ ended {transfer.state}: {transfer.error}")
                row["descs"] = transfer.num_descriptors
                agent.release(transfer)

            def memcpy(repeat: int) -> None:
                start = (repeat * (num_bytes // BLOCK_BYTES)) % POOL_BLOCKS
                stop = start + num_bytes // BLOCK_BYTES
                pool[start:stop].copy_(local_source[start:stop])

            pool.zero_()
            pull(0, None)
            if not torch.equal(pool[local_ids], expected[remote_ids]):
                raise RuntimeError(f"{name}: bytes read differ from the source")
            row["post"].clear()
            row.update(_time_interleaved({"memcpy": memcpy, "plain": lambda repeat: pull(repeat, None)}, repeats, hot))
            # Timed apart: a READ posted while an earlier notification still waits for the peer's
            # progress completes only after it, which would charge that wait to the plain READs.
            row.update(_time_interleaved({"notif": lambda repeat: pull(repeat, b"bench")}, repeats, hot))
            results.append(row)
    conn.send((results, _huge_page_kib()))


def _run(thp: bool, repeats: int, poll_interval_s: float, hot: bool) -> tuple[list, int | None, int | None]:
    # Children inherit the environment at spawn, before they import torch.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1" if thp else "0"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # keep the table readable
    context = multiprocessing.get_context("spawn")
    prefill_conn, prefill_child = context.Pipe()
    decode_conn, decode_child = context.Pipe()
    prefill = context.Process(target=_prefill_main, args=(prefill_child, poll_interval_s))
    decode = context.Process(target=_decode_main, args=(decode_child, repeats, hot))
    prefill.start()
    decode.start()
    try:
        source, prefill_huge_kib = prefill_conn.recv()
        decode_conn.send(source)
        results, decode_huge_kib = decode_conn.recv()
        prefill_conn.send("stop")
        prefill_conn.recv()
        return results, prefill_huge_kib, decode_huge_kib
    finally:
        for process in (decode, prefill):
            process.join(30)
            if process.is_alive():
                process.kill()


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thp", choices=("both", "on", "off"), default="both")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prefill-poll-ms", type=float, default=1.0, help="prefill's get_notifs() period")
    parser.add_argument("--hot", action="store_true", help="re-read the same blocks every repeat")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    settings = {"both": (False, True), "on": (True,), "off": (False,)}[args.thp]
    for thp in settings:
        results, prefill_huge_kib, decode_huge_kib = _run(thp, args.repeats, args.prefill_poll_ms / 1000, args.hot)
        print(
            f"\nTHP_MEM_ALLOC_ENABLE={int(thp)}: AnonHugePages prefill {prefill_huge_kib} KiB, decode "
            f"{decode_huge_kib} KiB; {args.repeats} repeats, {'hot' if args.hot else 'rotating'} blocks; "
            f"prefill polls every {args.prefill_poll_ms} ms"
        )
        print(
            f"{'GB/s: median (best)':<25}{'size':>7}{'descs':>6}{'memcpy':>15}{'READ+notif':>15}"
            f"{'READ':>15}{'READ/memcpy':>12}{'post ms':>9}"
        )
        for row in results:
            memcpy, notif, plain = (
                (_gbps(row["num_bytes"], statistics.median(row[key])), _gbps(row["num_bytes"], min(row[key])))
                for key in ("memcpy", "notif", "plain")
            )
            # The ratio is taken per repeat (a READ against the memcpy beside it), then the median.
            ratio = statistics.median(copy / read for copy, read in zip(row["memcpy"], row["plain"]))
            print(
                f"{row['name']:<25}{row['num_bytes'] >> 20:>4}MiB{row['descs']:>6}"
                f"{memcpy[0]:>8.2f} ({memcpy[1]:>5.2f}){notif[0]:>8.2f} ({notif[1]:>5.2f})"
                f"{plain[0]:>8.2f} ({plain[1]:>5.2f}){100 * ratio:>11.0f}%"
                f"{statistics.median(row['post']) * 1e3:>9.2f}"
            )

if __name__ == "__main__":
    main()
