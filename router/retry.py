"""How the router waits and gives up on a pod: the retry hint an overloaded pod sends, the backoff
between rounds of refusals, and the error that marks a pod frozen (no answer, no token)."""
from __future__ import annotations

import asyncio

import grpc

from shared.serving.pod.outcomes import RETRY_AFTER_KEY


class Stalled(Exception):
    """A pod sent nothing for the stall timeout: treated like a dead pod."""


def retry_after_s(error: grpc.aio.AioRpcError) -> float | None:
    """The pod's retry hint (trailing metadata RETRY_AFTER_KEY, milliseconds), if it sent one."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


class Backoff:
    """Waits between rounds of refusals, exponentially (or as long as the pods' hint says), for at
    most budget_s in all since the last call that made progress, and never past the deadline."""

    FIRST_S = 0.02
    LONGEST_S = 1.0

    def __init__(self, budget_s: float):
        self._budget_s = budget_s
        self.reset()

    def reset(self) -> None:
        self._next_s = self.FIRST_S
        self._hint_s: float | None = None
        self._waited_s = 0.0

    def hint(self, seconds: float | None) -> None:
        if seconds is not None:
            self._hint_s = max(seconds, self._hint_s or 0.0)

    def _delay(self, deadline) -> float:
        delay = self._hint_s if self._hint_s is not None else self._next_s
        delay = min(delay, self._budget_s - self._waited_s)
        remaining = deadline.remaining()
        return delay if remaining is None else min(delay, remaining)

    def can_wait(self, deadline) -> bool:
        return self._waited_s < self._budget_s and self._delay(deadline) > 0

    async def wait(self, deadline) -> None:
        delay = self._delay(deadline)
        await asyncio.sleep(delay)
        self._waited_s += delay
        self._next_s = min(self._next_s * 2, self.LONGEST_S)
        self._hint_s = None
