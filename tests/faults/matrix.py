"""Requests a fault scenario sends through the router, and the matrix row it yields: sent, correct,
failed by status, hung (no terminal status by the deadline + 5 s), corrupt (not the greedy reference
or a prefix of it), leaked (KV blocks still in use on a pod 2 s after the scenario)."""
from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from pdserve.client import build_generate_request
from shared.serving.wire.generate import generate_chunk_from_proto
from proto.pdserve.v1 import generate_pb2_grpc

HUNG_MARGIN_S = 5.0
# Reconnect fast: a restarted router is back within seconds.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
VOCAB_SIZE = 4096  # of the tiny preset


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for _ in range(num)]


# Every scenario's prompts; the reference is computed once for all of them, up to REFERENCE_TOKENS.
SHORT_PROMPTS = make_prompts(8, 40, seed=1)
LONG_PROMPTS = make_prompts(8, 1200, seed=2)  # a prefill step long enough to strike inside
REFERENCE_TOKENS = 200


@dataclass
class Result:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None  # None: no terminal status (hung)
    first_token_at: float | None = None


@dataclass
class Shot:
    """One request to send: when to give up on it (client cancel) and its deadline."""

    prompt: list[int]
    max_tokens: int
    deadline_s: float = 30.0
    cancel_after_s: float | None = None  # cancel this long after sending
    cancel_after_tokens: int | None = None  # cancel once this many tokens arrived


class Load:
    """Sends shots concurrently through the router; events let a scenario strike at a phase."""

    def __init__(self, router_address: str):
        self._channel = grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self.results: list[Result] = []
        self._token_counts: list[int] = []
        self._changed = asyncio.Event()

    async def close(self) -> None:
        await self._channel.close()

    def start(self, shots: list[Shot]) -> asyncio.Future:
        sends = []
        for shot in shots:
            self.results.append(Result(shot.prompt, shot.max_tokens))
            self._token_counts.append(0)
            sends.append(self._send(shot, self.results[-1], len(self._token_counts) - 1))
        return asyncio.gather(*sends)

    async def until(self, predicate: Callable[[list[int]], bool], timeout_s: float = 30.0) -> None:
        """Waits until predicate(tokens received per request so far) holds."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self._token_counts):
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the load never reached the phase the scenario waits for")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _send(self, shot: Shot, result: Result, index: int) -> None:
        try:
            await asyncio.wait_for(self._stream(shot, result, index), shot.deadline_s + HUNG_MARGIN_S)
        except asyncio.TimeoutError:
            result.code = None  # hung
        self._token_counts[index] = -1  # ended
        self._changed.set()

    async def _stream(self, shot: Shot, result: Result, index: int) -> None:
        request = build_generate_request(shot.prompt, max_tokens=shot.max_tokens, ignore_eos=True)
        call = self._stub.Generate(request, timeout=shot.deadline_s)
        canceller = None
        if shot.cancel_after_s is not None:
            canceller = asyncio.get_running_loop().call_later(shot.cancel_after_s, call.cancel)
        try:
            async for message in call:
                chunk = generate_chunk_from_proto(message)
                if result.first_token_at is None:
                    result.first_token_at = time.monotonic()
                result.tokens.extend(chunk.token_ids)
                self._token_counts[index] = len(result.tokens)
                self._changed.set()
                if shot.cancel_after_tokens is not None and len(result.tokens) >= shot.cancel_after_tokens:
                    call.cancel()
                    break
            result.code = await call.code()
        except grpc.aio.AioRpcError as exc:
            result.code = exc.code()
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            result.code = grpc.StatusCode.CANCELLED
        finally:
            if canceller is not None:
                canceller.cancel()
        if call.cancelled():
            result.code = grpc.StatusCode.CANCELLED


@dataclass
class Row:
    scenario: str
    sent: int = 0
    correct: int = 0
    failed: collections.Counter = field(default_factory=collections.Counter)
    hung: int = 0
    corrupt: int = 0
    leaked: int = 0
    notes: str = ""

    HEADER = ("scenario", "sent", "correct", "failed by status", "hung", "corrupt", "leaked")

    def cells(self) -> tuple[str, ...]:
        failed = ", ".join(f"{code} {n}" for code, n in sorted(self.failed.items())) or "-"
        return (self.scenario, str(self.sent), str(self.correct), failed, str(self.hung), str(self.corrupt),
                str(self.leaked))


def judge(scenario: str, results: list[Result], reference: Callable[[list[int], int], list[int]],
          leaked: dict[str, int]) -> Row:
    row = Row(scenario, sent=len(results), leaked=sum(leaked.values()))
    for result in results:
        expected = reference(result.prompt, result.max_tokens)
        if result.code is None:
            row.hung += 1
            continue
        is_prefix = result.tokens == expected[: len(result.tokens)]
        if not is_prefix:
            row.corrupt += 1
        elif result.code == grpc.StatusCode.OK and result.tokens == expected:
            row.correct += 1
        elif result.code == grpc.StatusCode.OK:
            row.corrupt += 1  # OK, but short or long
        else:
            row.failed[result.code.name] += 1
    return row


def format_table(rows: list[Row]) -> str:
    table = [Row.HEADER, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(Row.HEADER))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in table]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)
