"""The router's backoff between rounds of refusals: exponential, the pods' retry hint honoured,
bounded by its budget and by the client's deadline."""
import asyncio

import grpc
import pytest

from router.retry import Backoff, retry_after_s


class FixedDeadline:
    def __init__(self, remaining_s):
        self.remaining_s = remaining_s

    def remaining(self):
        return self.remaining_s


def waits(backoff: Backoff, deadline, num_rounds: int) -> list[float]:
    slept = []

    async def record(delay):
        slept.append(delay)

    real_sleep = asyncio.sleep
    asyncio.sleep = record
    try:
        for _ in range(num_rounds):
            if not backoff.can_wait(deadline):
                break
            asyncio.run(backoff.wait(deadline))
    finally:
        asyncio.sleep = real_sleep
    return slept


def test_backoff_doubles_up_to_its_longest_wait_and_stops_at_its_budget():
    slept = waits(Backoff(budget_s=3.0), FixedDeadline(None), 20)
    assert slept[:4] == pytest.approx([0.02, 0.04, 0.08, 0.16])
    assert max(slept) <= Backoff.LONGEST_S
    assert sum(slept) == pytest.approx(3.0)


def test_a_retry_hint_sets_the_next_wait_once():
    backoff = Backoff(budget_s=10.0)
    backoff.hint(0.5)
    backoff.hint(0.3)  # the longest hint of a round wins
    assert waits(backoff, FixedDeadline(None), 2) == pytest.approx([0.5, 0.04])


def test_backoff_never_waits_past_the_deadline():
    slept = waits(Backoff(budget_s=10.0), FixedDeadline(0.01), 1)
    assert slept == pytest.approx([0.01])


def test_reset_after_progress_restores_the_whole_budget():
    backoff = Backoff(budget_s=0.05)
    waits(backoff, FixedDeadline(None), 10)
    assert not backoff.can_wait(FixedDeadline(None))
    backoff.reset()
    assert backoff.can_wait(FixedDeadline(None))


class Refusal(grpc.aio.AioRpcError):
    def __init__(self, metadata):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata))


@pytest.mark.parametrize("metadata, expected", [
    ((("retry-after-ms", "250"),), 0.25),
    ((), None),
    ((("retry-after-ms", "soon"),), None),
])
def test_retry_hint_is_read_from_trailing_metadata(metadata, expected):
    assert retry_after_s(Refusal(metadata)) == expected
