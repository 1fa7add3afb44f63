"""`pdserve bench multi-turn`: conversations that share a system prompt and grow their history turn by
turn (each turn's prompt is the whole conversation so far, real answers included). Seeded. Turns run in
waves: every conversation finishes turn k before any starts turn k+1 (after its own think time), so the
pods' counters scraped between waves give each turn's prefix hit rate and KV bytes pulled exactly."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import FIRST_PROMPT_TOKEN_ID
from pdserve.bench_stats import summarize, token_timeline
from pdserve.client import AsyncPdserveClient
from pdserve.connection import add_connection_flags, connection_from_args

# Pods refresh their prefix-cache counters every 0.5 s (GAUGE_INTERVAL_S): wait this long after a
# wave before reading them (not counted in any figure).
COUNTER_SETTLE_S = 0.7
# Prometheus samples summed over every --metrics-url (pods of both tiers).
KV_BYTES = "pdserve_kv_transfer_bytes_total"
HIT_TOKENS = "pdserve_prefix_cache_hit_tokens_total"
QUERIED_TOKENS = "pdserve_prefix_cache_queried_tokens_total"


@dataclass(frozen=True)
class MultiTurnConfig:
    num_conversations: int = 8
    num_turns: int = 4
    system_prompt_len: int = 512  # tokens shared by every conversation
    user_len: int = 96  # tokens of each user message
    output_len: int = 32  # tokens of each answer (greedy, ignore_eos)
    think_time_s: float = 0.5  # mean pause before a conversation's next turn (exponential, seeded)
    vocab_size: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "user_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 0 or self.think_time_s < 0:
            raise ValueError("system_prompt_len and think_time_s must be >= 0")
        if self.vocab_size <= FIRST_PROMPT_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_PROMPT_TOKEN_ID}, got {self.vocab_size}")


@dataclass(frozen=True)
class Script:
    """Everything seeded about a run: the system prompt, each user message and each think time."""

    system_prompt: list[int]
    user_messages: list[list[list[int]]]  # [conversation][turn]
    think_times_s: list[list[float]]  # [conversation][turn]; turn 0 starts at once


def write_script(config: MultiTurnConfig) -> Script:
    rng = np.random.default_rng(config.seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(FIRST_PROMPT_TOKEN_ID, config.vocab_size, size=n).tolist()

    system = tokens(config.system_prompt_len)
    users = [[tokens(config.user_len) for _ in range(config.num_turns)] for _ in range(config.num_conversations)]
    thinks = [[0.0, *rng.exponential(config.think_time_s, size=config.num_turns - 1).tolist()]
              if config.think_time_s > 0 else [0.0] * config.num_turns for _ in range(config.num_conversations)]
    return Script(system, users, thinks)


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """The counters the report needs, summed over every metrics endpoint."""
    totals = dict.fromkeys((KV_BYTES, HIT_TOKENS, QUERIED_TOKENS), 0.0)
    for url in urls:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals


@dataclass
class _Turn:
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    error: str | None = None


async def _ask(client: AsyncPdserveClient, prompt: list[int], config: MultiTurnConfig, request_id: str,
               timeout_s: float) -> tuple[_Turn, list[int]]:
    turn, answer, chunks = _Turn(), [], []
    sent = time.perf_counter()
    try:
        async for chunk in client.generate(prompt, request_id=request_id, timeout=timeout_s,
                                           max_tokens=config.output_len, ignore_eos=True, temperature=0.0):
            chunks.append((time.perf_counter() - sent, len(chunk.token_ids)))
            answer.extend(chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        turn.error = f"{exc.code().name}: {exc.details()}"
    turn.ttft_s, _ = token_timeline(chunks)
    turn.e2e_s = chunks[-1][0] if chunks else None
    turn.num_output_tokens = len(answer)
    return turn, answer


async def run_multi_turn(target: str, config: MultiTurnConfig, metrics_urls: Sequence[str], *,
                         label: str = "multi-turn", timeout_s: float = 600.0,
                         connection: dict | None = None) -> dict[str, Any]:
    """Runs every conversation turn by turn; returns the report (per turn and overall). connection: the
    tls and api_token the server asks for (connection_from_args)."""
    script = write_script(config)
    histories = [list(script.system_prompt) for _ in range(config.num_conversations)]
    turns: list[dict[str, Any]] = []
    busy_s = 0.0
    run_id = time.time_ns()
    async with AsyncPdserveClient(target, **(connection or {})) as client:
        for k in range(config.num_turns):
            before = scrape(metrics_urls)
            started = time.perf_counter()

            async def one(c: int) -> _Turn:
                await asyncio.sleep(script.think_times_s[c][k])
                histories[c].extend(script.user_messages[c][k])
                turn, answer = await _ask(client, histories[c], config, f"{label}-{run_id}-c{c}-t{k}", timeout_s)
                histories[c].extend(answer)
                return turn

            results = await asyncio.gather(*(one(c) for c in range(config.num_conversations)))
            wave_s = time.perf_counter() - started
            busy_s += wave_s
            await asyncio.sleep(COUNTER_SETTLE_S)
            after = scrape(metrics_urls)
            turns.append(_turn_report(k, results, wave_s, before, after))
    num_output = sum(t["num_output_tokens"] for t in turns)
    later = [t for t in turns if t["turn"] > 0]
    return {
        "label": label,
        "target": target,
        "workload": asdict(config),
        "turns": turns,
        "num_failed": sum(t["num_failed"] for t in turns),
        "output_throughput": num_output / busy_s,
        "ttft_ms_later_turns": summarize([v for t in later for v in t["ttft_values_ms"]]),
        "kv_bytes_pulled": sum(t["kv_bytes_pulled"] for t in turns),
        "kv_bytes_pulled_later_turns": sum(t["kv_bytes_pulled"] for t in later),
    }


def _turn_report(k: int, results: Sequence[_Turn], wave_s: float, before: dict, after: dict) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    queried = after[QUERIED_TOKENS] - before[QUERIED_TOKENS]
    return {
        "turn": k,
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": wave_s,
        "num_output_tokens": sum(r.num_output_tokens for r in done),
        "ttft_ms": summarize([r.ttft_s for r in done if r.ttft_s is not None], 1000.0),
        "ttft_values_ms": [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None],
        "prefix_hit_rate": (after[HIT_TOKENS] - before[HIT_TOKENS]) / queried if queried else None,
        "kv_bytes_pulled": after[KV_BYTES] - before[KV_BYTES],
    }


def markdown_table(reports: Sequence[dict[str, Any]]) -> str:
    lines = ["| run | turn | done/failed | TTFT p50 / p90 (ms) | prefix hit rate | KV bytes pulled | out tok/s |",
             "|---|---|---|---|---|---|---|"]
    for report in reports:
        for t in report["turns"]:
            hit = "-" if t["prefix_hit_rate"] is None else f"{t['prefix_hit_rate']:.1%}"
            lines.append(
                f"| {report['label']} | {t['turn'] + 1} | {t['num_completed']}/{t['num_failed']} "
                f"| {t['ttft_ms']['p50']:.1f} / {t['ttft_ms']['p90']:.1f} | {hit} "
                f"| {t['kv_bytes_pulled']:,.0f} | {t['num_output_tokens'] / t['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def build_arg_parser() -> argparse.ArgumentParser:
    d = MultiTurnConfig()
    parser = argparse.ArgumentParser(prog="pdserve bench multi-turn", description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of a Generate server")
    parser.add_argument("--metrics-url", action="append", default=[],
                        help="a pod's Prometheus URL (repeat for every pod) for hit rate and KV bytes")
    parser.add_argument("--num-conversations", type=int, default=d.num_conversations)
    parser.add_argument("--num-turns", type=int, default=d.num_turns)
    parser.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len)
    parser.add_argument("--user-len", type=int, default=d.user_len)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--think-time-s", type=float, default=d.think_time_s)
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--label", default="multi-turn")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    add_connection_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        config = MultiTurnConfig(
            num_conversations=args.num_conversations, num_turns=args.num_turns,
            system_prompt_len=args.system_prompt_len, user_len=args.user_len, output_len=args.output_len,
            think_time_s=args.think_time_s, vocab_size=args.vocab_size, seed=args.seed,
        )
        connection = connection_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    report = asyncio.run(run_multi_turn(args.target, config, args.metrics_url, label=args.label,
                                        connection=connection))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(markdown_table([report]), end="")
    return 0 if report["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
