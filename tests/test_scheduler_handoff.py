"""The scheduler's side of the KV handoff: what it reports as handed off, and the common-prefix
count when requests that do not run (held for a peer, waiting for remote KV) share blocks."""
from __future__ import annotations

import pytest

from loopback_connector import LoopbackHandle
from sched_utils import EOS_TOKEN_ID, create_scheduler
from shared.engine.kv_transfer.handoff import HoldForPeer
from shared.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from shared.engine.sched.output import ModelRunnerOutput

PREFIX = list(range(100, 132))  # two full blocks of 16


def _request(req_id: str, prompt: list[int], max_tokens: int = 50, **kwargs) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), EOS_TOKEN_ID, **kwargs)


def _step(scheduler, token: int = 7):
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    runner_out = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[token] for _ in ids]
    )
    return out, scheduler.update_from_output(out, runner_out)


@pytest.mark.parametrize("max_model_len,handed_off", [(41, False), (42, True)])
def test_a_prompt_at_the_model_length_is_not_handed_off(max_model_len, handed_off):
    scheduler = create_scheduler(
        use_kv_connector=True, kv_role="kv_producer", max_model_len=max_model_len, max_num_batched_tokens=64
    )
    scheduler.add_request(_request("p", PREFIX + [1] * 8, max_tokens=1, kv_transfer_params=HoldForPeer()))
    _, result = _step(scheduler)
    [output] = result.outputs
    assert output.finish_reason is FinishReason.LENGTH
    assert (output.kv_handle is not None) is handed_off
    assert scheduler.num_held_requests == int(handed_off)
    if not handed_off:
        assert scheduler.get_kv_usage().num_used_blocks == 0


def test_a_stop_token_at_token_1_is_not_handed_off():
    scheduler = create_scheduler(use_kv_connector=True, kv_role="kv_producer")
    scheduler.add_request(
        Request("p", PREFIX + [1] * 8, SamplingParams(max_tokens=1), EOS_TOKEN_ID, kv_transfer_params=HoldForPeer())
    )
    _, result = _step(scheduler, token=EOS_TOKEN_ID)
    [output] = result.outputs
    assert output.finish_reason is FinishReason.STOP and output.kv_handle is None
    assert scheduler.num_held_requests == 0


def test_common_prefix_ignores_blocks_held_for_a_peer():
    scheduler = create_scheduler(use_kv_connector=True, kv_role="kv_producer", enable_prefix_caching=True)
    scheduler.add_request(_request("held", PREFIX + [1] * 8, max_tokens=1, kv_transfer_params=HoldForPeer()))
    _, result = _step(scheduler)
    assert result.outputs[0].kv_handle is not None and scheduler.num_held_requests == 1
    # "a" hits the held request's two prefix blocks; "b" shares nothing with either.
    scheduler.add_request(_request("a", PREFIX + [2] * 8))
    scheduler.add_request(_request("b", list(range(300, 340))))
    out, _ = _step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert out.num_common_prefix_blocks == [0]


def test_common_prefix_counts_blocks_every_running_request_shares_besides_a_held_one():
    scheduler = create_scheduler(use_kv_connector=True, kv_role="kv_producer", enable_prefix_caching=True)
    scheduler.add_request(_request("held", PREFIX + [1] * 8, max_tokens=1, kv_transfer_params=HoldForPeer()))
    _step(scheduler)
    scheduler.add_request(_request("a", PREFIX + [2] * 8))
    scheduler.add_request(_request("b", PREFIX + [3] * 8))
    out, _ = _step(scheduler)
    assert out.num_common_prefix_blocks == [2]


def test_common_prefix_ignores_blocks_of_a_request_waiting_for_remote_kv():
    scheduler = create_scheduler(use_kv_connector=True, kv_role="kv_consumer", enable_prefix_caching=True)
    scheduler.add_request(_request("a", PREFIX + [2] * 8))
    scheduler.add_request(_request("b", list(range(300, 340))))
    out, _ = _step(scheduler)
    assert out.num_common_prefix_blocks == [0]
    # "w" hits a's two prefix blocks, then waits for the rest of its prompt from a peer.
    handle = LoopbackHandle("P", "w", (1, 2, 3, 4), num_tokens=60, block_size=16, lease_deadline=float("inf"))
    scheduler.add_request(_request("w", PREFIX + [4] * 29, kv_transfer_params=handle))
    out, _ = _step(scheduler)
    assert scheduler.requests["w"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert out.num_common_prefix_blocks == [0]
