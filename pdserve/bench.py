"""`pdserve bench`: a load generator for the public Generate API. Sends a seeded random workload
(Poisson arrivals or all at once), measures TTFT, TPOT, ITL and E2E per request, and writes a JSON
report and latency-CDF plots."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc
import numpy as np

from pdserve.bench_openai import CallFailed, OpenAiBenchClient
from pdserve.connection import add_connection_flags, connection_from_args
from pdserve.bench_stats import RequestRecord, Slo, build_report, markdown_table, request_rows, token_timeline
from pdserve.client import AsyncPdserveClient
from pdserve.launcher import DEFAULT_PORTS

# Token ids below this are left out of prompts (the usual pad/bos/eos slots).
FIRST_PROMPT_TOKEN_ID = 3


@dataclass(frozen=True)
class WorkloadConfig:
    """The request mix. Lengths are uniform integers in [len*(1-r), len*(1+r)] (at least 1)."""

    num_requests: int = 128
    rate: float = math.inf  # requests per second (Poisson arrivals); inf sends everything at once
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    vocab_size: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (or inf), got {self.rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.vocab_size <= FIRST_PROMPT_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_PROMPT_TOKEN_ID}, got {self.vocab_size}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return out


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float  # when to send it, seconds after the run starts


def _length_bounds(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def generate_workload(config: WorkloadConfig) -> list[BenchRequest]:
    """The same config (seed included) always gives the same requests and arrival times."""
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    in_low, in_high = _length_bounds(config.input_len, config.range_ratio)
    out_low, out_high = _length_bounds(config.output_len, config.range_ratio)
    input_lens = rng.integers(in_low, in_high, size=n, endpoint=True)
    output_lens = rng.integers(out_low, out_high, size=n, endpoint=True)
    if math.isinf(config.rate):
        arrivals = np.zeros(n)
    else:
        gaps = rng.exponential(1.0 / config.rate, size=n)
        gaps[0] = 0.0  # the first request goes out at once
        arrivals = np.cumsum(gaps)
    return [
        BenchRequest(
            index=i,
            prompt_token_ids=rng.integers(FIRST_PROMPT_TOKEN_ID, config.vocab_size, size=int(input_lens[i])).tolist(),
            max_tokens=int(output_lens[i]),
            arrival_s=float(arrivals[i]),
        )
        for i in range(n)
    ]


# ---- running ---------------------------------------------------------------------------------


class Progress:
    """A plain-text progress line on stderr (rewritten in place on a terminal, every 10% otherwise)."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.num_done = self.num_failed = 0
        self._is_tty = sys.stderr.isatty()
        self._next_mark = 0.1

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += 0 if record.is_success else 1
        if not self.enabled:
            return
        line = f"[{self.label}] {self.num_done}/{self.total} done, {self.num_failed} failed"
        if self._is_tty:
            sys.stderr.write("\r" + line + ("\n" if self.num_done == self.total else ""))
            sys.stderr.flush()
        elif self.num_done / self.total >= self._next_mark or self.num_done == self.total:
            self._next_mark = math.floor(self.num_done / self.total * 10 + 1) / 10
            print(line, file=sys.stderr, flush=True)


async def _send(client: AsyncPdserveClient, request: BenchRequest, request_id: str,
                timeout_s: float | None, run_start: float) -> RequestRecord:
    record = RequestRecord(request.index, len(request.prompt_token_ids), request.max_tokens)
    chunks: list[tuple[float, int]] = []
    finish = None
    sent = time.perf_counter()
    record.start_s = sent - run_start
    try:
        async for chunk in client.generate(
            request.prompt_token_ids, request_id=request_id, timeout=timeout_s,
            max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0,
        ):
            chunks.append((time.perf_counter() - sent, len(chunk.token_ids)))
            finish = chunk.finish_reason
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    except CallFailed as exc:
        record.error = str(exc)
    record.num_output_tokens = sum(n for _, n in chunks)
    record.ttft_s, record.itl_s = token_timeline(chunks)
    record.e2e_s = chunks[-1][0] if chunks else None
    if record.error is None:
        if finish is None:
            record.error = "the stream ended without a finish reason"
        elif record.num_output_tokens != request.max_tokens:
            record.error = f"expected {request.max_tokens} tokens (ignore_eos), got {record.num_output_tokens}"
    return record


async def run_workload(client: AsyncPdserveClient, requests: Sequence[BenchRequest], *, label: str = "bench",
                       request_timeout_s: float | None = None, progress: bool = True,
                       id_prefix: str = "bench") -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time over the client's channel; returns (records, duration
    seconds) where the duration runs from the first send to the last response."""
    bar = Progress(label, len(requests), progress)
    run_start = time.perf_counter()

    async def one(request: BenchRequest) -> RequestRecord:
        delay = run_start + request.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await _send(client, request, f"{id_prefix}-{request.index}", request_timeout_s, run_start)
        bar.update(record)
        return record

    records = await asyncio.gather(*(one(r) for r in requests))
    return list(records), time.perf_counter() - run_start


async def warm_up(client: AsyncPdserveClient, config: WorkloadConfig, num_warmups: int,
                  timeout_s: float | None) -> None:
    """Short sequential requests (not measured): lazy initialisation and the channel's connection
    set-up stay out of the figures."""
    warmup = generate_workload(WorkloadConfig(
        num_requests=max(1, num_warmups), input_len=config.input_len, output_len=4, range_ratio=0.0,
        vocab_size=config.vocab_size, seed=config.seed + 1_000_003,
    ))
    for request in warmup[:num_warmups]:
        record = await _send(client, request, f"warmup-{request.index}-{time.time_ns()}", timeout_s, 0.0)
        if not record.is_success:
            raise RuntimeError(f"warm-up request failed: {record.error}")


BACKENDS = ("grpc", "openai")
DEFAULT_TARGETS = {
    "grpc": f"127.0.0.1:{DEFAULT_PORTS.router}", "openai": f"http://127.0.0.1:{DEFAULT_PORTS.http}/v1",
}


def bench_client(backend: str, target: str, connection: dict | None = None):
    """grpc: the Generate RPC at host:port; openai: the HTTP API's /v1/completions under a base URL.
    connection: the tls and api_token the server asks for (connection_from_args)."""
    connection = connection or {}
    if backend == "openai":
        return OpenAiBenchClient(target, **connection)
    return AsyncPdserveClient(target, **connection)


async def run_benchmark(target: str, config: WorkloadConfig, *, slo: Slo = Slo(), label: str = "bench",
                        request_timeout_s: float | None = None, num_warmups: int = 1,
                        progress: bool = True, backend: str = "grpc", connection: dict | None = None) -> dict[str, Any]:
    """Warm up, run the workload, and return the full report (figures, workload, per-request rows)."""
    requests = generate_workload(config)
    async with bench_client(backend, target, connection) as client:
        await warm_up(client, config, num_warmups, request_timeout_s)
        load_before = os.getloadavg()  # other work on the machine skews the figures: keep the evidence
        records, duration = await run_workload(
            client, requests, label=label, request_timeout_s=request_timeout_s, progress=progress,
            id_prefix=f"{label}-{time.time_ns()}",
        )
    report = {"label": label, "target": target, "backend": backend, "workload": config.to_json(),
              **build_report(records, duration, slo), "load_average_before": load_before, "load_average_after": os.getloadavg()}
    report["requests"] = request_rows(records)
    return report


# ---- output ----------------------------------------------------------------------------------


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "bench"


def write_report(report: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    """<label>.json and, when matplotlib is installed, <label>_latency_cdf.png; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = safe_label(report["label"])
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False))
    paths = [json_path]
    if plots:
        try:
            from pdserve.bench_plot import plot_latency_cdfs

            paths.append(plot_latency_cdfs([report], out_dir / f"{name}_latency_cdf.png", title=report["label"]))
        except ImportError as exc:
            print(f"bench: no plots ({exc}); install matplotlib", file=sys.stderr)
    return paths


def format_summary(report: dict[str, Any]) -> str:
    lines = [
        f"{report['label']} -> {report['target']}: {report['num_completed']} done, {report['num_failed']} failed "
        f"in {report['duration_s']:.2f}s",
        f"  throughput: {report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} output tok/s",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = report[key]
        if s["mean"] is not None:
            lines.append(
                f"  {name:4} ms: mean {s['mean']:.2f}  p50 {s['p50']:.2f}  p90 {s['p90']:.2f}  p99 {s['p99']:.2f}"
            )
    if report["goodput"] is not None:
        lines.append(f"  goodput: {report['goodput']:.2f} req/s ({report['num_slo_met']} requests met the SLOs)")
    if "load_average_before" in report:
        lines.append(f"  load average (1 min) before / after: {report['load_average_before'][0]:.2f} / "
                     f"{report['load_average_after'][0]:.2f} (on {os.cpu_count()} CPUs)")
    for error in report["errors"]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------


def parse_rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate must be a number or 'inf', got {value!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 (or inf), got {value!r}")
    return rate


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    d = WorkloadConfig()
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--input-len", type=int, default=d.input_len, help="mean prompt length (tokens)")
    parser.add_argument("--output-len", type=int, default=d.output_len, help="mean output length (tokens)")
    parser.add_argument("--range-ratio", type=float, default=d.range_ratio,
                        help="lengths are uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size, help="prompt ids are uniform in [3, vocab)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT objective for goodput")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT objective for goodput")
    parser.add_argument("--num-warmups", type=int, default=1, help="short unmeasured requests sent first")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of each request")
    parser.add_argument("--no-plots", action="store_true", help="write JSON only")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS, default="grpc",
                        help="grpc: the Generate RPC; openai: the OpenAI-compatible HTTP API (streamed completions)")
    parser.add_argument("--target", default=None, help="grpc: host:port of a Generate server; openai: the API's "
                        f"base URL (defaults: {DEFAULT_TARGETS['grpc']} and {DEFAULT_TARGETS['openai']})")
    parser.add_argument("--rate", type=parse_rate, default=math.inf,
                        help="requests per second (Poisson arrivals), or 'inf' to send all at once")
    add_workload_flags(parser)
    parser.add_argument("--out-dir", type=Path, default=Path("out/bench"), help="where JSON and plots go")
    parser.add_argument("--label", default=None, help="run name (file names, legends); default bench-rate<R>")
    add_connection_flags(parser)
    return parser


def workload_from_args(args: argparse.Namespace, rate: float) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=args.num_requests, rate=rate, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, vocab_size=args.vocab_size, seed=args.seed,
    )


def slo_from_args(args: argparse.Namespace) -> Slo:
    ms = lambda value: None if value is None else value / 1000.0  # noqa: E731
    return Slo(ttft_s=ms(args.ttft_slo_ms), tpot_s=ms(args.tpot_slo_ms))


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when at least one request completed, 1 when all failed, 2 on bad flags or no server.
    `pdserve bench multi-turn ...` runs the multi-turn conversation workload instead."""
    if argv and argv[0] == "multi-turn":
        from pdserve.bench_multiturn import main as multi_turn_main

        return multi_turn_main(argv[1:])
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        config = workload_from_args(args, args.rate)
        slo = slo_from_args(args)
        connection = connection_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    label = args.label or f"bench-rate{config.to_json()['rate']}"
    try:
        report = asyncio.run(run_benchmark(
            args.target or DEFAULT_TARGETS[args.backend], config, slo=slo, label=label,
            request_timeout_s=args.request_timeout_s, num_warmups=args.num_warmups, backend=args.backend,
            connection=connection,
        ))
    except RuntimeError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    paths = write_report(report, args.out_dir, plots=not args.no_plots)
    print(format_summary(report))
    print(markdown_table([report]), end="")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["num_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
