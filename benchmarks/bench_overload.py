"""Overload, side by side in one run: the split system (router + prefill + decode processes on 127.0.0.1)
first with the pods' default limits, then with --max-queue-time. Each is measured unloaded, at capacity,
then offered twice its capacity. Prints the p50 latency of the served requests against the unloaded
figure, the requests refused (and whether before or after token 1: after token 1 there must be none), the
peak decode queue, and a burst all at once after it that fits the queue-time budget (served whole).

A pod predicts a new request's time in the system from the requests in flight and the rate it finishes
them (Little's law), so a budget near the unloaded latency keeps each tier's share of a served request's
latency near it. Without --max-queue-time the budget is the unloaded p50 the default-limits run measured.

    python benchmarks/bench_overload.py [--input-len 128] [--output-len 64] [--duration 20] [--max-queue-time S]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import grpc

from pdserve.bench import BenchRequest, WorkloadConfig, generate_workload, run_workload
from pdserve.bench_stats import RequestRecord, percentile
from pdserve.client import AsyncPdserveClient
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import common_pb2, decode_pb2_grpc


def _p50_e2e(records: list[RequestRecord]) -> float:
    return percentile([r.e2e_s for r in records if r.is_success], 50)


async def _unloaded(client: AsyncPdserveClient, requests: list[BenchRequest]) -> list[RequestRecord]:
    """One request at a time."""
    records = []
    for request in requests:
        done, _ = await run_workload(client, [replace(request, arrival_s=0.0)], progress=False,
                                     id_prefix=f"unloaded-{time.time_ns()}")
        records.extend(done)
    return records


async def _watch_decode_queue(address: str, peak: list[int], stop: asyncio.Event) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        while not stop.is_set():
            load = (await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)).load
            peak[0] = max(peak[0], load.num_waiting)
            await asyncio.sleep(0.1)


async def _capacity(client: AsyncPdserveClient, config: WorkloadConfig) -> float:
    """Served requests per second in a burst of one full batch per pod."""
    burst = generate_workload(replace(config, num_requests=64, seed=2))
    burst_records, burst_s = await run_workload(client, burst, progress=False, id_prefix="capacity")
    return sum(r.is_success for r in burst_records) / burst_s


async def measure(router: str, decode: str, config: WorkloadConfig, duration_s: float,
                  budget_s: float | None, capacity: float | None) -> dict:
    """capacity: the default-limits run's (None: measure it here; a budget refuses most of a burst)."""
    async with AsyncPdserveClient(router) as client:
        await run_workload(client, generate_workload(replace(config, num_requests=4, seed=99)), progress=False,
                           id_prefix="warmup")
        unloaded = await _unloaded(client, generate_workload(replace(config, num_requests=12, seed=1)))
        if capacity is None:
            capacity = await _capacity(client, config)
        rate = 2 * capacity
        overload = generate_workload(replace(config, num_requests=max(1, round(rate * duration_s)), rate=rate, seed=3))
        peak, stop = [0], asyncio.Event()
        watcher = asyncio.create_task(_watch_decode_queue(decode, peak, stop))
        records, _ = await run_workload(client, overload, progress=False, id_prefix="overload",
                                        request_timeout_s=60)
        stop.set()
        await watcher
        await asyncio.sleep(2.0)  # the overload's queues drain
        # A burst all at once that the pods finish within the queue-time budget (or the capacity burst's size
        # without one): with the measurements the overload left, it must still be served whole.
        size = max(1, round(capacity * budget_s)) if budget_s is not None else 64
        burst_after, _ = await run_workload(client, generate_workload(replace(config, num_requests=size, seed=4)),
                                            progress=False, id_prefix="burst-after", request_timeout_s=60)
    return {"unloaded": unloaded, "capacity": capacity, "rate": rate, "overload": records, "peak_queue": peak[0],
            "burst_after": burst_after}


def report(figures: dict) -> str:
    unloaded_p50 = _p50_e2e(figures["unloaded"])
    records = figures["overload"]
    served = [r for r in records if r.is_success]
    refused_before = collections.Counter(r.error.split(":")[0] for r in records
                                         if not r.is_success and r.num_output_tokens == 0)
    failed_after = collections.Counter(r.error.split(":")[0] for r in records
                                       if not r.is_success and r.num_output_tokens > 0)
    served_p50 = _p50_e2e(records) if served else float("nan")
    lines = [
        f"unloaded (one at a time, {len(figures['unloaded'])} requests): p50 e2e {unloaded_p50 * 1000:.0f} ms",
        f"capacity (a burst of 64 with the default limits): {figures['capacity']:.1f} requests/s",
        f"2x overload: offered {figures['rate']:.1f} requests/s, {len(records)} requests",
        f"  served {len(served)}, p50 e2e {served_p50 * 1000:.0f} ms = {served_p50 / unloaded_p50:.2f}x unloaded "
        f"(p90 {percentile([r.e2e_s for r in served], 90) * 1000:.0f} ms)" if served else "  served 0",
        f"  refused before token 1: {dict(refused_before) or 0}",
        f"  errors after token 1: {dict(failed_after) or 0}",
        f"  peak decode queue (waiting requests): {figures['peak_queue']}",
        f"burst of {len(figures['burst_after'])} at once after it: served "
        f"{sum(r.is_success for r in figures['burst_after'])}, p50 e2e {_p50_e2e(figures['burst_after']) * 1000:.0f} ms",
    ]
    return "\n".join(lines)


def _run(pod_args: list[str], config: WorkloadConfig, duration_s: float, budget_s: float | None,
         capacity: float | None = None) -> dict:
    with tempfile.TemporaryDirectory() as logs, LocalCluster.start(
        pod_args=pod_args, log_dir=Path(logs), timeout_s=600
    ) as cluster:
        return asyncio.run(measure(cluster.router.address, cluster.by_name("decode-0").address, config,
                                   duration_s, budget_s, capacity))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of 2x overload")
    parser.add_argument("--max-requests-in-flight", type=int, default=None,
                        help="the pods' admission limit (default: the pods' own default)")
    parser.add_argument("--max-queue-time", type=float, default=None,
                        help="the second run's predicted-wait limit in seconds (default: the unloaded p50 of the "
                             "first run)")
    args = parser.parse_args()
    config = WorkloadConfig(input_len=args.input_len, output_len=args.output_len, range_ratio=0.0)
    pod_args = ["--model", args.model]
    if args.max_requests_in_flight is not None:
        pod_args += ["--max-requests-in-flight", str(args.max_requests_in_flight)]
    default_run = _run(pod_args, config, args.duration, None)
    print("pods with the default limits")
    print(report(default_run))
    budget_s = args.max_queue_time
    if budget_s is None:
        budget_s = round(_p50_e2e(default_run["unloaded"]), 3)
    budget_run = _run(pod_args + ["--max-queue-time", str(budget_s)], config, args.duration, budget_s,
                      capacity=default_run["capacity"])
    print(f"\npods with --max-queue-time {budget_s:g}")
    print(report(budget_run))


if __name__ == "__main__":
    main()
