"""Statistics of a serving benchmark: per-request latency records, percentiles, SLO goodput and the
JSON-ready run report (plus its one-line-per-run markdown table)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one benchmark request measured. Times are seconds; start_s is relative to the run start."""

    index: int
    num_prompt_tokens: int
    num_expected_output_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def token_timeline(chunks: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """(TTFT, inter-token gaps) from (seconds since send, tokens in the message) per streamed message.

    A message may carry several tokens (everything ready since the previous one). Its gap since the
    previous message is split evenly over its tokens, so the gaps always sum to last - first message
    time; extra tokens in the first message arrived together with token 1 and count as gaps of 0.
    """
    ttft = None
    last = None
    gaps: list[float] = []
    for at, num_tokens in chunks:
        if num_tokens <= 0:
            continue
        if ttft is None:
            ttft = last = at
            gaps.extend([0.0] * (num_tokens - 1))
            continue
        gap = (at - last) / num_tokens
        gaps.extend([gap] * num_tokens)
        last = at
    return ttft, gaps


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 of values times scale (e.g. 1000 for seconds -> ms); None when empty."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    scaled = [v * scale for v in values]
    out: dict[str, float | None] = {"mean": sum(scaled) / len(scaled)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(scaled, q)
    return out


@dataclass(frozen=True)
class Slo:
    """Latency objectives; None means no objective on that figure."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    @property
    def is_set(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def is_met(self, record: RequestRecord) -> bool:
        """A failed request never meets it; a one-token request has no TPOT to miss."""
        if not record.is_success:
            return False
        if self.ttft_s is not None and (record.ttft_s is None or record.ttft_s > self.ttft_s):
            return False
        tpot = record.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def build_report(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The run's figures: latency summaries (ms), throughputs, failures and goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.is_success]
    failed = [r for r in records if not r.is_success]
    num_output = sum(r.num_output_tokens for r in done)
    num_input = sum(r.num_prompt_tokens for r in done)
    met = sum(1 for r in done if slo.is_met(r)) if slo.is_set else None
    return {
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:10],
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": num_output / duration_s,
        "total_token_throughput": (num_input + num_output) / duration_s,
        "ttft_ms": summarize([r.ttft_s for r in done if r.ttft_s is not None], 1000.0),
        "tpot_ms": summarize([r.tpot_s for r in done if r.tpot_s is not None], 1000.0),
        "itl_ms": summarize([g for r in done for g in r.itl_s], 1000.0),
        "e2e_ms": summarize([r.e2e_s for r in done if r.e2e_s is not None], 1000.0),
        "slo": {"ttft_ms": _ms(slo.ttft_s), "tpot_ms": _ms(slo.tpot_s)},
        "num_slo_met": met,
        "goodput": None if met is None else met / duration_s,
    }


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per-request raw figures (ms) for the JSON file and the CDF plots."""
    return [
        {
            "index": r.index,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "start_ms": r.start_s * 1000.0,
            "ttft_ms": _ms(r.ttft_s),
            "tpot_ms": _ms(r.tpot_s),
            "e2e_ms": _ms(r.e2e_s),
            "itl_ms": [g * 1000.0 for g in r.itl_s],
            "error": r.error,
        }
        for r in records
    ]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


TABLE_HEADER = (
    "| label | rate (req/s) | done/failed | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) "
    "| ITL p50 / p99 (ms) | E2E p50 (ms) | req/s | out tok/s | goodput (req/s) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(report: dict[str, Any]) -> str:
    def f(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    ttft, tpot, itl, e2e = report["ttft_ms"], report["tpot_ms"], report["itl_ms"], report["e2e_ms"]
    rate = report["workload"]["rate"]
    return (
        f"| {report['label']} | {rate if isinstance(rate, str) else f(rate)} "
        f"| {report['num_completed']}/{report['num_failed']} "
        f"| {f(ttft['p50'])} / {f(ttft['p90'])} / {f(ttft['p99'])} "
        f"| {f(tpot['p50'])} / {f(tpot['p90'])} / {f(tpot['p99'])} "
        f"| {f(itl['p50'])} / {f(itl['p99'])} | {f(e2e['p50'])} "
        f"| {f(report['request_throughput'], 2)} | {f(report['output_throughput'], 0)} "
        f"| {f(report['goodput'], 2)} |"
    )


def markdown_table(reports: Sequence[dict[str, Any]]) -> str:
    return "\n".join([TABLE_HEADER, *(table_row(r) for r in reports)]) + "\n"
