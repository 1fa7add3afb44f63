"""The NIXL connector's hold and pull decisions, driven directly with a controllable clock.

Transfers themselves are covered by tests/test_nixl_transfer.py and the split-system tests.
"""
from __future__ import annotations

import dataclasses

import pytest

from shared.engine.kv_cache.hashing import prompt_digest
from shared.engine.kv_transfer.connector import KVConnectorBase, KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handle import (
    KvHandleNotAuthentic, KvHandleOtherPrompt, KvLayout, KvPullOutcome, KvSource,
)
from shared.engine.kv_transfer.handle_signing import HandleSigner
from shared.engine.kv_transfer.handoff import HoldForPeer, PullFromPeer, hands_off
from shared.engine.kv_transfer.nixl_consumer import NixlConsumer
from shared.engine.kv_transfer.nixl_producer import NixlProducer
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


# The digest of _finished_prefill's default prompt: what an honest decode pod confirms with.
PROMPT_DIGEST = prompt_digest(list(range(3, 43)), LAYOUT.block_size)
SOURCE = KvSource("prefill-agent", b"", "DRAM", regions=(), block_bytes=1024, num_blocks=64)


def _agent() -> KvTransferAgent:
    return KvTransferAgent(KvTransferAgent.unique_name("test"))


# The pods' own defaults (PodConfig) are not the connectors': each test names what it runs with.
RECOMPUTE = KVLoadFailurePolicy.RECOMPUTE


def _producer(clock: Clock, *, lease_s: float = 30.0, **kwargs) -> NixlProducer:
    return NixlProducer(engine_id="kv_producer-1", layout=LAYOUT, agent=_agent(), clock=clock,
                        source_address="127.0.0.1:1", lease_s=lease_s, load_failure_policy=RECOMPUTE, **kwargs)


def _consumer(clock: Clock, *, confirm_release=None, **kwargs) -> NixlConsumer:
    return NixlConsumer(engine_id="kv_consumer-1", layout=LAYOUT, agent=_agent(), clock=clock,
                        load_failure_policy=RECOMPUTE, confirm_release=confirm_release, **kwargs)


def _finished_prefill(status: RequestStatus, num_prompt_tokens: int = 40, do_remote_decode: bool = True) -> Request:
    request = Request("r1", list(range(3, 3 + num_prompt_tokens)), SamplingParams(max_tokens=1), eos_token_id=2,
                      kv_transfer_params=HoldForPeer() if do_remote_decode else None)
    request.status = status
    return request


def test_producer_holds_only_the_prompt_blocks_of_a_handoff(clock):
    connector = _producer(clock, lease_s=5.0)
    delay, handle = connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [7, 8, 9, 10])
    assert delay is True
    assert handle.block_ids == (7, 8, 9)  # 40 tokens: 3 blocks; the 4th held token 1's slot only
    assert handle.num_tokens == 40
    assert handle.lease_deadline_unix_ms == 1005_000
    assert connector.num_held_blocks == 3


@pytest.mark.parametrize(
    "status,params,num_prompt_tokens,expected",
    [
        (RequestStatus.FINISHED_LENGTH_CAPPED, HoldForPeer(), 40, True),
        (RequestStatus.FINISHED_LENGTH_CAPPED, HoldForPeer(max_tokens=8), 40, True),
        (RequestStatus.FINISHED_LENGTH_CAPPED, HoldForPeer(max_tokens=1), 40, False),  # token 1 was all it wanted
        (RequestStatus.FINISHED_LENGTH_CAPPED, HoldForPeer(), 63, False),  # token 1 reached the model's length
        (RequestStatus.FINISHED_STOPPED, HoldForPeer(), 40, False),  # EOS or a stop token
        (RequestStatus.FINISHED_ABORTED, HoldForPeer(), 40, False),
        (RequestStatus.FINISHED_LENGTH_CAPPED, None, 40, False),  # it never asked
    ],
)
def test_one_predicate_decides_the_handoff(status, params, num_prompt_tokens, expected):
    request = Request("r1", list(range(3, 3 + num_prompt_tokens)), SamplingParams(max_tokens=1), eos_token_id=2,
                      kv_transfer_params=params)
    request.append_output_token_ids([7])
    request.status = status
    assert hands_off(request, max_model_len=64) is expected


def test_producer_frees_at_once_when_no_decode_follows(clock):
    connector = _producer(clock)
    request = _finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED, do_remote_decode=False)
    assert connector.request_finished(request, [1, 2, 3]) == (False, None)
    assert connector.num_held_blocks == 0


def test_release_is_intact_only_within_the_lease_and_for_the_same_engine(clock):
    connector = _producer(clock, lease_s=5.0)
    connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert connector.release("r1", "kv_producer-other", PROMPT_DIGEST) is False  # a restarted engine's id
    assert connector.num_held_blocks == 3
    clock.now += 4.9
    assert connector.release("r1", "kv_producer-1", PROMPT_DIGEST) is True
    assert connector.get_finished(set()) == ({"r1"}, None)  # the scheduler frees the blocks now
    assert connector.release("r1", "kv_producer-1", PROMPT_DIGEST) is False  # released once only


def test_expired_lease_frees_the_hold_and_a_late_release_is_not_intact(clock):
    connector = _producer(clock, lease_s=5.0)
    connector.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert connector.get_finished(set()) == (None, None)
    clock.now += 5.0
    assert connector.get_finished(set()) == ({"r1"}, None)
    assert connector.num_lease_expiries == 1
    assert connector.release("r1", "kv_producer-1", PROMPT_DIGEST) is False


def _decode_request(handle) -> Request:
    prompt = list(range(3, 3 + handle.num_tokens))
    return Request("r1", prompt + [99], SamplingParams(max_tokens=4), eos_token_id=2,
                   kv_transfer_params=PullFromPeer(handle, SOURCE, handle.prompt_digest))


def _handle(clock: Clock, lease_s: float = 5.0):
    producer = _producer(clock, lease_s=lease_s)
    _, handle = producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    return handle


def test_consumer_pulls_the_tokens_beyond_its_prefix_cache(clock):
    consumer = _consumer(clock)
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
def test_precheck_says_why_a_handle_cannot_be_pulled(clock, change, outcome):
    consumer = _consumer(clock)
    handle = _handle(clock)
    assert consumer.pull_precheck(handle) is None
    assert consumer.pull_precheck(change(clock, handle)) is outcome


def test_consumer_with_the_whole_prompt_cached_reads_nothing(clock):
    consumer = _consumer(clock, confirm_release=lambda handle, request_id, digest, on_result: None)
    handle = _handle(clock)
    assert consumer.get_num_new_matched_tokens(_decode_request(handle), 48) == (0, False)
    stats = consumer.get_pull_stats()["r1"]
    assert stats.outcome is KvPullOutcome.PREFIX_CACHE_HIT and stats.num_cached_blocks == 3


def test_the_base_contract_means_nothing_to_transfer():
    connector = KVConnectorBase(KVRole.BOTH, RECOMPUTE)
    request = _finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert connector.load_failure_policy is KVLoadFailurePolicy.RECOMPUTE
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert connector.request_finished(request, [1, 2, 3]) == (False, None)
    assert connector.build_connector_meta(None).requests == []
    assert connector.has_pending_work() is False
    assert connector.get_finished(set()) == (None, None)
    assert connector.get_block_ids_with_load_errors() == set()


def test_handoff_params_are_immutable(clock):
    handle = _handle(clock)
    params = PullFromPeer(handle, SOURCE, handle.prompt_digest)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.handle = None
    assert HoldForPeer() == HoldForPeer()


def test_each_side_acts_only_on_its_own_kind_of_params(clock):
    producer, consumer = _producer(clock), _consumer(clock)
    assert producer.role is KVRole.PRODUCER and consumer.role is KVRole.CONSUMER
    pulling = _decode_request(_handle(clock))
    pulling.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.request_finished(pulling, [1, 2, 3]) == (False, None)  # a pull is not a hold
    holding = _finished_prefill(RequestStatus.WAITING)
    assert consumer.get_num_new_matched_tokens(holding, 0) == (0, False)  # a hold is not a pull
    assert consumer.request_finished(holding, [1, 2, 3]) == (False, None)


def test_producer_has_pending_work_while_a_hold_is_open_or_unreported(clock):
    producer = _producer(clock, lease_s=5.0)
    assert producer.has_pending_work() is False
    producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert producer.has_pending_work() is True
    assert producer.release("r1", "kv_producer-1", PROMPT_DIGEST) is True
    assert producer.has_pending_work() is True  # released, but the scheduler has not freed the blocks yet
    assert producer.get_finished(set()) == ({"r1"}, None)
    assert producer.has_pending_work() is False


def test_consumer_pull_is_planned_for_the_missing_blocks_only(clock):
    consumer = _consumer(clock)
    handle = _handle(clock)
    request = _decode_request(handle)
    assert consumer.get_num_new_matched_tokens(request, 16) == (24, True)
    consumer.update_state_after_alloc(request, [10, 11, 12, 13], 24)
    [pull] = consumer.build_connector_meta(None).requests
    assert (pull.local_block_ids, pull.remote_block_ids, pull.num_cached_blocks) == ([11, 12], [2, 3], 1)
    assert consumer.build_connector_meta(None).requests == []  # handed over once
    # One attempt per request: asked again (a resumed request), it recomputes.
    assert consumer.get_num_new_matched_tokens(request, 0) == (0, False)


def test_consumer_has_pending_work_until_a_confirmation_is_applied(clock):
    consumer = _consumer(clock)
    assert consumer.has_pending_work() is False
    consumer.on_release_result("r1", True)  # from the gRPC side
    assert consumer.has_pending_work() is True
    assert consumer.get_finished(set()) == (None, None)  # no pull of that id: nothing lands
    assert consumer.has_pending_work() is False


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(block_size=0), "block_size must be > 0"),
        (dict(block_size=8), "differs from handle.layout.block_size"),
        (dict(num_tokens=0, block_ids=()), "num_tokens must be > 0"),
        (dict(block_ids=(1, 2)), "need 3"),
    ],
)
def test_a_handle_of_the_wrong_shape_cannot_be_built(clock, fields, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(_handle(clock), **fields)


def test_an_abort_after_the_step_that_made_the_hold_frees_the_blocks_at_once():
    from shared.engine.llm_engine import LLMEngine
    from shared.engine.sched_config import CacheConfig, SchedulerConfig

    connector = NixlProducer(engine_id="kv_producer-1", layout=LAYOUT, agent=_agent(), lease_s=600.0,
                             load_failure_policy=RECOMPUTE)
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=512), CacheConfig(block_size=16, num_blocks=64),
                       connector=connector)
    engine.add_request(Request("r1", list(range(3, 43)), SamplingParams(max_tokens=1),
                               eos_token_id=engine.eos_token_id, kv_transfer_params=HoldForPeer()))
    while engine.has_unfinished_requests():
        engine.step()
    assert connector.num_held_blocks == 3  # finished: held for a decode pod under a 10-minute lease
    engine.abort_request("r1")  # the caller gave up after the step that made the hold
    engine.step()
    assert connector.num_held_blocks == 0
    assert engine.num_free_blocks == engine.num_total_blocks
    connector.shutdown()


KEY = b"k" * 32


def test_producer_binds_the_hold_to_its_prompt_and_signs_the_handle(clock):
    producer = _producer(clock, lease_s=5.0, signer=HandleSigner(KEY))
    _, handle = producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert handle.prompt_digest == PROMPT_DIGEST
    assert HandleSigner(KEY).is_authentic(handle)
    assert not HandleSigner(b"x" * 32).is_authentic(handle)  # another deployment's key


def test_release_for_another_prompt_is_not_intact(clock):
    producer = _producer(clock, lease_s=5.0)
    producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    other = prompt_digest(list(range(4, 44)), LAYOUT.block_size)
    assert producer.release("r1", "kv_producer-1", other) is False
    # The hold ended (its blocks go back to the pool); nobody can confirm it afterwards.
    assert producer.get_finished(set()) == ({"r1"}, None)
    assert producer.release("r1", "kv_producer-1", PROMPT_DIGEST) is False


def test_release_without_a_digest_abandons_the_hold(clock):
    producer = _producer(clock, lease_s=5.0)
    producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    assert producer.release("r1", "kv_producer-1") is False
    assert producer.num_held_blocks == 0


@pytest.mark.parametrize("field,value", [
    ("block_ids", (1, 2, 4)), ("num_tokens", 41), ("lease_deadline_unix_ms", 10**15), ("engine_id", "kv_producer-2"),
    ("source_address", "10.0.0.1:1"), ("prompt_digest", b"\0" * 32), ("signature", b""),
    ("layout", dataclasses.replace(LAYOUT, model_name="other@0")),
])
def test_consumer_refuses_a_tampered_handle_before_reading(clock, field, value):
    signer = HandleSigner(KEY)
    producer = _producer(clock, lease_s=5.0, signer=signer)
    _, handle = producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    consumer = _consumer(clock, signer=signer)
    consumer.check_handle(handle, PROMPT_DIGEST)  # the honest handle passes
    with pytest.raises(KvHandleNotAuthentic):
        consumer.check_handle(dataclasses.replace(handle, **{field: value}), PROMPT_DIGEST)


def test_consumer_refuses_an_authentic_handle_for_another_prompt(clock):
    signer = HandleSigner(KEY)
    producer = _producer(clock, lease_s=5.0, signer=signer)
    _, handle = producer.request_finished(_finished_prefill(RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2, 3])
    consumer = _consumer(clock, signer=signer)
    with pytest.raises(KvHandleOtherPrompt):
        consumer.check_handle(handle, prompt_digest(list(range(4, 44)), LAYOUT.block_size))


def test_prompt_digest_covers_the_partial_last_block():
    base = list(range(3, 43))
    assert prompt_digest(base, 16) == prompt_digest(list(base), 16)
    assert prompt_digest(base, 16) != prompt_digest(base[:-1] + [0], 16)
    assert prompt_digest(base, 16) != prompt_digest(base + [1], 16)


def test_a_short_handle_key_is_refused():
    with pytest.raises(ValueError, match="at least"):
        HandleSigner(b"short")


@pytest.mark.parametrize("intact, outcome", [
    (True, KvPullOutcome.PULLED),
    (False, KvPullOutcome.RECOMPUTED_LEASE_EXPIRED),  # the prefill pod said its hold was gone
    (None, KvPullOutcome.RECOMPUTED_ERROR),  # it could not be asked: its hold may stand, the router ends it
])
def test_a_pull_is_used_only_when_prefill_confirms_its_hold(clock, intact, outcome):
    from types import SimpleNamespace

    from shared.engine.kv_transfer.transfer import TransferState

    consumer = _consumer(clock)
    request = _decode_request(_handle(clock))
    consumer.get_num_new_matched_tokens(request, 0)
    consumer.update_state_after_alloc(request, [10, 11, 12], 40)
    [pull] = consumer.build_connector_meta(None).requests
    # The READ is over (DONE) and ReleaseKv was asked: only its answer decides.
    pull.transfer = SimpleNamespace(state=TransferState.DONE, num_bytes=3072, seconds=0.01)
    pull.is_confirming = True
    consumer._pulls[pull.request_id] = pull
    consumer.on_release_result("r1", intact)
    assert consumer.get_finished(set()) == (None, {"r1"})
    assert consumer.get_pull_stats()["r1"].outcome is outcome


def test_a_pull_is_stuck_after_its_bytes_time_and_never_waits_past_its_holds_lease(clock):
    consumer = _consumer(clock)
    request = _decode_request(_handle(clock, lease_s=60.0))
    consumer.get_num_new_matched_tokens(request, 0)
    consumer.update_state_after_alloc(request, [10, 11, 12], 40)
    [pull] = consumer.build_connector_meta(None).requests
    post = lambda: consumer.start_load_kv(type(consumer.build_connector_meta(None))(requests=[pull]))  # noqa: E731
    post()
    assert pull.timeout_s == 5.0  # 3 small blocks: the floor
    pull.source = dataclasses.replace(SOURCE, block_bytes=100 * 2**20, regions=(None,) * 2)  # 600 MiB in all
    post()
    assert pull.timeout_s == pytest.approx(12.0)  # their time at 50 MiB/s
    clock.now += 55
    post()
    assert pull.timeout_s == pytest.approx(5.0)  # what is left of the lease
    clock.now += 4.9
    post()
    assert pull.timeout_s == 1.0  # a lease about to end still leaves a pull a moment
