"""The NIXL connector's hold and pull decisions, driven directly with a controllable clock.

Transfers themselves are covered by tests/test_nixl_transfer.py and the split-system tests.
"""
from __future__ import annotations

import dataclasses

import pytest

from shared.engine.kv_transfer.connector import KVRole
from shared.engine.kv_transfer.handle import KvLayout, KvPullOutcome
from shared.engine.kv_transfer.nixl_connector import DO_REMOTE_DECODE, REMOTE_HANDLE, NixlConnector
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent
from shared.engine.request import Request, RequestStatus, SamplingParams

pytestmark = pytest.mark.e2e

LAYOUT = KvLayout("tiny@0", "float32", num_layers=4, num_kv_heads=4, head_dim=32, block_size=16)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def _connector(role: KVRole, clock: Clock, **kwargs) -> NixlConnector:
    agent = KvTransferAgent(KvTransferAgent.unique_name("test"))
    return NixlConnector(role, engine_id=f"{role.value}-1", layout=LAYOUT, agent=agent, clock=clock,
                         source_address="127.0.0.1:1", **kwargs)


def _finished_prefill(status: RequestStatus, num_prompt_tokens: int = 40, do_remote_decode: bool = True) -> Request:
    request = Request("r1", list(range(3, 3 + num_prompt_tokens)), SamplingParams(max_tokens=1), eos_token_id=2,
                      kv_transfer_params={DO_REMOTE_DECODE: do_remote_decode})
    request.status = status
    return request


def test_producer_holds_only_the_prompt_blocks_of_a_handoff(clock):
    connector = _connector(KVRole.PRODUCER, clock, lease_s=5.0)
    delay, params = connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [7, 8, 9, 10])
    handle = params[REMOTE_HANDLE]
    assert delay is True
    assert handle.block_ids == (7, 8, 9)  # 40 tokens: 3 blocks; the 4th held token 1's slot only
    assert handle.num_tokens == 40
    assert handle.lease_deadline_unix_ms == 1005_000
    assert connector.num_held_blocks == 3


@pytest.mark.parametrize(
    "status,do_remote_decode",
    [(RequestStatus.FINISHED_STOPPED, True), (RequestStatus.FINISHED_ABORTED, True),
     (RequestStatus.FINISHED_LENGTH_CAPPED, False)],
)
def test_producer_frees_at_once_when_no_decode_follows(clock, status, do_remote_decode):
    connector = _connector(KVRole.PRODUCER, clock)
    assert connector.request_finished(_finished_prefill(status, do_remote_decode=do_remote_decode), [1, 2, 3]) == (False, None)
    assert connector.num_held_blocks == 0


def test_release_is_intact_only_within_the_lease_and_for_the_same_engine(clock):
    connector = _connector(KVRole.PRODUCER, clock, lease_s=5.0)
    connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert connector.release("r1", "kv_producer-other") is False  # a restarted engine's id
    assert connector.num_held_blocks == 3
    clock.now += 4.9
    assert connector.release("r1", "kv_producer-1") is True
    assert connector.get_finished(set()) == ({"r1"}, None)  # the scheduler frees the blocks now
    assert connector.release("r1", "kv_producer-1") is False  # released once only


def test_expired_lease_frees_the_hold_and_a_late_release_is_not_intact(clock):
    connector = _connector(KVRole.PRODUCER, clock, lease_s=5.0)
    connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert connector.get_finished(set()) == (None, None)
    clock.now += 5.0
    assert connector.get_finished(set()) == ({"r1"}, None)
    assert connector.num_lease_expiries == 1
    assert connector.release("r1", "kv_producer-1") is False


def _decode_request(handle) -> Request:
    prompt = list(range(3, 3 + handle.num_tokens))
    return Request("r1", prompt + [99], SamplingParams(max_tokens=4), eos_token_id=2,
                   kv_transfer_params={REMOTE_HANDLE: handle})


def _handle(clock: Clock):
    producer = _connector(KVRole.PRODUCER, clock, lease_s=5.0)
    _, params = producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    return params[REMOTE_HANDLE]


def test_consumer_pulls_the_tokens_beyond_its_prefix_cache(clock):
    consumer = _connector(KVRole.CONSUMER, clock)
    handle = _handle(clock)
    assert consumer.get_num_new_matched_tokens(_decode_request(handle), 16) == (24, True)


@pytest.mark.parametrize(
    "change,outcome",
    [
        (lambda clock, handle: dataclasses.replace(handle, layout=dataclasses.replace(LAYOUT, dtype="bfloat16")),
         KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH),
        (lambda clock, handle: setattr(clock, "now", clock.now + 6) or handle, KvPullOutcome.RECOMPUTED_LEASE_EXPIRED),
    ],
)
def test_consumer_recomputes_without_pulling_when_the_kv_cannot_be_used(clock, change, outcome):
    consumer = _connector(KVRole.CONSUMER, clock)
    released = []
    consumer.release_remote = lambda handle, request_id: released.append(request_id)
    handle = change(clock, _handle(clock))
    assert consumer.get_num_new_matched_tokens(_decode_request(handle), 0) == (0, False)
    assert consumer.pop_pull_stats("r1").outcome is outcome
    assert released == ["r1"]  # the prefill pod's hold is ended at once


def test_consumer_with_the_whole_prompt_cached_reads_nothing(clock):
    consumer = _connector(KVRole.CONSUMER, clock)
    consumer.release_remote = lambda handle, request_id: None
    handle = _handle(clock)
    assert consumer.get_num_new_matched_tokens(_decode_request(handle), 48) == (0, False)
    stats = consumer.pop_pull_stats("r1")
    assert stats.outcome is KvPullOutcome.PREFIX_CACHE_HIT and stats.num_cached_blocks == 3
