"""The load of the planner's local run (bench_planner_local.py): Poisson arrivals whose prompt:output shape
shifts by phase, each request streamed over the router's OpenAI-compatible HTTP API, its TTFT, ITL (mean time
per output token after the first) and outcome recorded; and the router's rotation sampled every second."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from pdserve.bench_openai import CallFailed, OpenAiBenchClient
from pdserve.local_pods import read_rotation

VOCAB_SIZE = 4096  # of the tiny preset


@dataclass(frozen=True)
class Phase:
    prompt_tokens: int
    output_tokens: int
    seconds: float

    def label(self) -> str:
        return f"{self.prompt_tokens}:{self.output_tokens}"


@dataclass
class Record:
    phase: int
    sent_s: float  # since the run's start
    num_asked: int
    num_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    error: str | None = None

    @property
    def is_lost(self) -> bool:
        """Failed, or ended short of the tokens asked for (ignore_eos: every request runs to max_tokens)."""
        return self.error is not None or self.num_tokens != self.num_asked


async def run_load(http_url: str, phases: list[Phase], rate_per_s: float, jitter: float, seed: int,
                   started: float) -> list[Record]:
    rng = random.Random(seed)
    records: list[Record] = []
    calls: list[asyncio.Task] = []
    async with OpenAiBenchClient(http_url) as client:
        phase_end = 0.0
        for index, phase in enumerate(phases):
            phase_end += phase.seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate_per_s))
                now = time.monotonic() - started
                if now >= phase_end:
                    break
                prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(_jittered(phase.prompt_tokens, jitter, rng))]
                record = Record(index, now, _jittered(phase.output_tokens, jitter, rng))
                records.append(record)
                calls.append(asyncio.ensure_future(_call(client, prompt, record, len(records))))
        await asyncio.gather(*calls)
    return records


def _jittered(value: int, jitter: float, rng: random.Random) -> int:
    return max(2, round(value * rng.uniform(1 - jitter, 1 + jitter)))


async def _call(client: OpenAiBenchClient, prompt: list[int], record: Record, number: int) -> None:
    began = time.monotonic()
    first = last = None
    try:
        async for chunk in client.generate(prompt, request_id=f"planner-run-{number}", timeout=600,
                                           max_tokens=record.num_asked, ignore_eos=True, temperature=0.0):
            if chunk.token_ids:
                last = time.monotonic()
                first = first or last
                record.num_tokens += len(chunk.token_ids)
    except CallFailed as exc:
        record.error = str(exc)
    if first is not None:
        record.ttft_s = first - began
        if record.num_tokens > 1:
            record.itl_s = (last - first) / (record.num_tokens - 1)


async def sample_rotation(metrics_url: str, started: float, samples: list[tuple[float, int, int]],
                          stop: asyncio.Event) -> None:
    """Every second: (seconds since the start, prefill pods, decode pods) healthy in the router's rotation."""
    while not stop.is_set():
        try:
            rotation = await asyncio.to_thread(read_rotation, metrics_url)
            counts = {tier: sum(1 for (t, _), up in rotation.items() if t == tier and up == 1.0)
                      for tier in ("prefill", "decode")}
            samples.append((time.monotonic() - started, counts["prefill"], counts["decode"]))
        except OSError:
            pass  # the router answered late: the next second's sample covers it
        await asyncio.sleep(1.0)
