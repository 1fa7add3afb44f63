"""The fault matrix: each scenario strikes the running system (router + two pods per tier) at one
phase of its requests, then checks that every request ended in time with the reference output (or a
prefix of it when it failed) and that no pod keeps a KV block afterwards. Killed pods are restarted
on their ports, so every scenario finds two pods per tier."""
from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from fault_cluster import DECODE, LEASE_S, PREFILL
from matrix import LONG_PROMPTS, SHORT_PROMPTS, Load, Shot, judge

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.timeout(180)]

# A block is leaked when it outlives every lease that could hold it (plus the pods' half-second gauge
# refresh and a margin). That a cancel or a finished pull frees the blocks at once, well before the lease
# ends, is test_cancel_frees_pool's (FREE_WITHIN_S < LEASE_S) and the split-system tests'.
LEAK_WINDOW_S = LEASE_S + 2.0
FREEZE_S = 4.0  # longer than the router's stall timeout


def _short(max_tokens: int, **options) -> list[Shot]:
    return [Shot(prompt, max_tokens, **options) for prompt in SHORT_PROMPTS[:6]]


def _long(max_tokens: int, **options) -> list[Shot]:
    return [Shot(prompt, max_tokens, **options) for prompt in LONG_PROMPTS[:6]]


def _all_have(num_tokens: int):
    return lambda counts: all(count >= num_tokens or count < 0 for count in counts)


def _any_has(num_tokens: int):
    return lambda counts: any(count >= num_tokens for count in counts)


# The moments a scenario strikes at: a time after its requests were sent, or a point of their streams.
def _after_s(seconds: float):
    return lambda load: asyncio.sleep(seconds)


def _once_all_have(num_tokens: int):
    return lambda load: load.until(_all_have(num_tokens))


def _once_any_has(num_tokens: int):
    return lambda load: load.until(_any_has(num_tokens))


async def _strike(cluster, load, shots: list[Shot], *, at, service: str, sig: signal.Signals,
                  freeze_s: float = FREEZE_S) -> None:
    """Sends the shots, waits for the moment `at`, signals `service`, and waits for every shot to end. A
    stopped service (SIGSTOP) continues after freeze_s; a killed or terminated one is restarted on its
    ports once the shots ended."""
    done = load.start(shots)
    await at(load)
    cluster.send(service, sig)
    if sig is signal.SIGSTOP:
        await asyncio.sleep(freeze_s)
        cluster.send(service, signal.SIGCONT)
    await done
    if sig in (signal.SIGKILL, signal.SIGTERM):
        await asyncio.to_thread(cluster.restart, service)


# Each scenario drives one Load and returns True when every request must succeed (a second pod of
# the tier was there to take over), False when failing requests are the point (cancel, deadline).

async def baseline(cluster, load):
    await load.start(_short(24))
    return True


async def prefill_sigkill_while_computing(cluster, load):
    await _strike(cluster, load, _long(16), at=_after_s(0.05), service="prefill-0", sig=signal.SIGKILL)
    return True


async def prefill_sigkill_after_token1_before_pull(cluster, load):
    await _strike(cluster, load, _long(48), at=_once_any_has(1), service="prefill-0", sig=signal.SIGKILL)
    return True


async def decode_sigkill_midstream(cluster, load):
    await _strike(cluster, load, _short(200), at=_once_all_have(3), service="decode-0", sig=signal.SIGKILL)
    return True


async def prefill_sigstop(cluster, load):
    await _strike(cluster, load, _long(16), at=_after_s(0.02), service="prefill-0", sig=signal.SIGSTOP)
    return True


async def decode_sigstop(cluster, load):
    await _strike(cluster, load, _short(200), at=_once_all_have(3), service="decode-0", sig=signal.SIGSTOP)
    return True


async def decode_frozen_still_in_rotation(cluster, load):
    """Frozen just before the requests come, while its slow probes still keep it in rotation: each
    request's decode pod is confirmed by a fresh probe before token 1 goes out, so no request gets token 1
    and then fails over (or fails) on the frozen pod."""
    retries = _router_decode_retries(cluster)
    # Idle pods tie on cost and load: the router picks the lowest address, so that is the one frozen, and
    # the requests go one after another (each would pick it again while it is still in rotation).
    frozen = min(DECODE, key=cluster.address)
    cluster.send(frozen, signal.SIGSTOP)
    try:
        for shot in _short(24):
            await load.start([shot])
    finally:
        cluster.send(frozen, signal.SIGCONT)
    assert _router_decode_retries(cluster) == retries, "a request met the frozen decode pod after token 1"
    return True


async def lease_expiry_under_load(cluster, load):
    before = _lease_expiries(cluster)
    # A frozen router pulls nothing: the holds of the prompts computing now outlive their lease.
    await _strike(cluster, load, [Shot(prompt, 16) for prompt in LONG_PROMPTS], at=_once_any_has(1),
                  service="router", sig=signal.SIGSTOP, freeze_s=LEASE_S + 1.0)
    await asyncio.sleep(0.6)  # the pods refresh their counters every half second
    assert _lease_expiries(cluster) > before, "no lease ran out: the scenario did not test expiry"
    return True


async def cancel_in_prefill(cluster, load):
    await load.start(_long(16, cancel_after_s=0.03))
    return False


async def cancel_at_token1(cluster, load):
    """Also: the router counts each such call as cancelled, not as an error."""
    errors, cancels = _router_outcome(cluster, "error"), _router_outcome(cluster, "cancelled")
    shots = _long(64, cancel_after_tokens=1)
    await load.start(shots)
    num_cancelled = sum(result.code == grpc.StatusCode.CANCELLED for result in load.results)
    for _ in range(50):  # the router ends its side of a cancelled call a moment after the client
        if _router_outcome(cluster, "cancelled") - cancels >= num_cancelled:
            break
        await asyncio.sleep(0.1)
    assert num_cancelled > 0
    assert _router_outcome(cluster, "cancelled") - cancels == num_cancelled
    assert _router_outcome(cluster, "error") == errors
    return False


async def cancel_midstream(cluster, load):
    await load.start(_short(200, cancel_after_tokens=5))
    return False


async def deadline_in_prefill(cluster, load):
    shots = [Shot(prompt, 16, deadline_s=0.02 * (i + 1)) for i, prompt in enumerate(LONG_PROMPTS[:6])]
    await load.start(shots)
    return False


async def deadline_midstream(cluster, load):
    await load.start(_short(200, deadline_s=0.5))
    return False


async def router_restart(cluster, load):
    await _strike(cluster, load, _short(200), at=_once_all_have(2), service="router", sig=signal.SIGKILL)
    await asyncio.to_thread(cluster.wait_ready, ("router",))
    after = Load(cluster.router_address)
    try:
        await after.start([Shot(prompt, 16) for prompt in SHORT_PROMPTS[:4]])
    finally:
        await after.close()
    assert all(r.code == grpc.StatusCode.OK for r in after.results), [r.code for r in after.results]
    load.results.extend(after.results)
    return False


async def prefill_sigterm_drain(cluster, load):
    await _strike(cluster, load, _long(16), at=_after_s(0.05), service="prefill-0", sig=signal.SIGTERM)
    return True


async def decode_sigterm_drain(cluster, load):
    await _strike(cluster, load, _short(100), at=_once_all_have(3), service="decode-0", sig=signal.SIGTERM)
    return True


def _router_outcome(cluster, outcome: str) -> float:
    return cluster.counter("router", "pdserve_router_requests_total", outcome=outcome)


def _router_decode_retries(cluster) -> float:
    return cluster.counter("router", "pdserve_router_retries_total", tier="decode")


def _lease_expiries(cluster) -> float:
    return sum(cluster.gauges(name).get("pdserve_lease_expiries_total", 0.0) for name in PREFILL)


ALL = ("router", *PREFILL, *DECODE)
ANY = ("router",)  # the router waits for one healthy pod per tier itself

# (scenario, the services it needs SERVING when it starts). A pod a scenario restarts comes back
# while later scenarios that do not strike its tier run.
SCENARIOS = [
    (baseline, ALL),
    (prefill_sigkill_while_computing, ALL),
    (decode_sigkill_midstream, ("router", *DECODE)),
    (cancel_in_prefill, ANY),
    (cancel_at_token1, ANY),
    (cancel_midstream, ANY),
    (deadline_in_prefill, ANY),
    (deadline_midstream, ANY),
    (prefill_sigkill_after_token1_before_pull, ("router", *PREFILL)),
    (decode_sigstop, ("router", *DECODE)),
    (decode_frozen_still_in_rotation, ("router", *DECODE)),
    (router_restart, ANY),
    (prefill_sigstop, ("router", *PREFILL)),
    (lease_expiry_under_load, ALL),
    (decode_sigterm_drain, ("router", *DECODE)),
    (prefill_sigterm_drain, ("router", *PREFILL)),
]


async def _drive(scenario, cluster):
    load = Load(cluster.router_address)
    try:
        must_all_succeed = await scenario(cluster, load)
    finally:
        await load.close()
    return load.results, must_all_succeed


@pytest.mark.parametrize("scenario, needs", SCENARIOS, ids=[scenario.__name__ for scenario, _ in SCENARIOS])
def test_fault_scenario(scenario, needs, fault_cluster, reference, fault_matrix):
    fault_cluster.ensure_running(needs)
    try:
        results, must_all_succeed = asyncio.run(_drive(scenario, fault_cluster))
    finally:
        fault_cluster.ensure_running(("router",))
    leaked = fault_cluster.wait_blocks_free(LEAK_WINDOW_S)
    row = judge(scenario.__name__, results, reference, leaked)
    fault_matrix.append(row)
    assert (row.hung, row.corrupt, row.leaked) == (0, 0, 0), f"{row}; blocks in use: {leaked}"
    if must_all_succeed:
        assert row.correct == row.sent, row
