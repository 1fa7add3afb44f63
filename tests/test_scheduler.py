"""The scheduler spec (vLLM v1 tests/v1/core/test_scheduler.py), ported to pdserve's API.

Internals the spec pokes (req_to_blocks, num_preallocate_blocks, scheduled_req_ids) are checked
through the KV-cache manager's own API; pdserve preallocates no blocks (num_preallocate_blocks = 0).
"""
from __future__ import annotations

from unittest.mock import Mock

import pytest

from sched_utils import EOS_TOKEN_ID, create_requests, create_scheduler
from shared.engine.request import FinishReason, PlaceholderRange, RequestStatus
from shared.engine.sched.output import CachedRequestData, KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from shared.engine.sched.scheduler import Scheduler

NUM_PREALLOCATE_BLOCKS = 0


def _runner_output(req_ids, sampled_token_ids, spec_token_ids=None) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled_token_ids,
        spec_token_ids=spec_token_ids,
        logprobs=None,
        prompt_logprobs_dict={},
    )


def _scheduler_output(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
        scheduled_encoder_inputs={},
        scheduled_spec_decode_tokens=spec_tokens,
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
    )


def _put_running(scheduler: Scheduler, requests) -> None:
    # The spec's direct insertion: requests already computed up to their last token.
    for req in requests:
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        scheduler.requests[req.request_id] = req
        scheduler.running.append(req)


def test_add_requests():
    scheduler = create_scheduler()
    requests = create_requests(num_requests=10)

    for i, request in enumerate(requests):
        scheduler.add_request(request)
        assert request.request_id in scheduler.requests
        assert len(scheduler.waiting) == i + 1


def test_finish_request():
    scheduler = create_scheduler()
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)

    for i, request in enumerate(requests):
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        assert request.request_id not in scheduler.requests
        assert len(scheduler.waiting) == 9 - i


def test_get_num_unfinished_requests():
    scheduler = create_scheduler()
    requests = create_requests(num_requests=10)
    for request in requests:
        scheduler.add_request(request)

    for i, request in enumerate(requests):
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        assert scheduler.get_num_unfinished_requests() == len(requests) - i - 1


@pytest.mark.parametrize("enable_prefix_caching, prompt_logprobs", [(None, None), (True, 5)])
def test_schedule(enable_prefix_caching, prompt_logprobs):
    """Default prefix caching without prompt logprobs; prefix caching on with prompt logprobs."""
    scheduler = create_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = create_requests(num_requests=10, prompt_logprobs=prompt_logprobs)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == len(requests)
    assert len(output.scheduled_cached_reqs) == 0
    assert len(output.finished_req_ids) == 0
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        assert num_tokens == len(requests[int(req_id)].prompt_token_ids)

    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == len(requests)
    for i, request in enumerate(requests):
        assert scheduler.running[i] == request


def test_schedule_multimodal_requests():
    scheduler = create_scheduler(model="llava-hf/llava-1.5-7b-hf")
    mm_positions = [[PlaceholderRange(offset=i, length=100)] for i in range(10)]
    requests = create_requests(num_requests=10, num_tokens=200, mm_positions=mm_positions)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == len(requests)
    assert len(output.scheduled_cached_reqs) == 0
    assert len(output.finished_req_ids) == 0
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        assert num_tokens == len(requests[int(req_id)].prompt_token_ids)
    assert len(output.scheduled_encoder_inputs) == 10
    for req_id, encoder_input in output.scheduled_encoder_inputs.items():
        assert len(encoder_input) == 1


def test_schedule_partial_requests():
    """Several partial requests in one step under the encoder budget; a RUNNING request may go
    unscheduled in a later step when the encoder budget is short."""
    scheduler = create_scheduler(model="llava-hf/llava-1.5-7b-hf", max_num_batched_tokens=1024)
    mm_positions = [[PlaceholderRange(offset=100, length=600)] for _ in range(3)]
    requests = create_requests(num_requests=3, num_tokens=800, mm_positions=mm_positions)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 3
    assert len(output.scheduled_cached_reqs) == 0
    assert len(output.finished_req_ids) == 0

    assert scheduler.max_num_encoder_input_tokens == 1024
    # The first request is scheduled fully.
    assert output.num_scheduled_tokens[requests[0].request_id] == 800
    # The second and third only up to their image: the encoder budget is spent.
    assert output.num_scheduled_tokens[requests[1].request_id] == 100
    assert output.num_scheduled_tokens[requests[2].request_id] == 100
    # Only the first request samples; the others are still prefilling.
    model_runner_output = _runner_output([r.request_id for r in requests], [[0], [], []])
    scheduler.update_from_output(output, model_runner_output)

    # Only the first and second requests are scheduled; the third stays RUNNING, unscheduled.
    output = scheduler.schedule()
    assert len(scheduler.running) == 3
    assert len(output.scheduled_new_reqs) == 0
    assert len(output.scheduled_cached_reqs) == 2
    assert len(output.finished_req_ids) == 0
    assert output.num_scheduled_tokens[requests[0].request_id] == 1
    assert output.num_scheduled_tokens[requests[1].request_id] == 700
    assert requests[2].request_id not in output.num_scheduled_tokens


def test_no_mm_input_chunking():
    scheduler = create_scheduler(
        model="llava-hf/llava-1.5-7b-hf", max_num_batched_tokens=1024, disable_chunked_mm_input=True
    )
    mm_positions = [[PlaceholderRange(offset=400, length=800)]]
    requests = create_requests(num_requests=1, num_tokens=1200, mm_positions=mm_positions)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 1
    assert len(output.scheduled_cached_reqs) == 0
    assert len(output.finished_req_ids) == 0
    # Only the 400 text tokens before the image.
    assert output.num_scheduled_tokens[requests[0].request_id] == 400

    model_runner_output = _runner_output([r.request_id for r in requests], [[] for _ in requests])
    scheduler.update_from_output(output, model_runner_output)

    output = scheduler.schedule()
    assert len(scheduler.running) == 1
    assert len(output.scheduled_new_reqs) == 0
    assert len(output.scheduled_cached_reqs) == 1
    assert len(output.finished_req_ids) == 0
    assert output.num_scheduled_tokens[requests[0].request_id] == 800

    # A budget below the largest multimodal input cannot work without chunking it.
    with pytest.raises(ValueError):
        _ = create_scheduler(
            model="llava-hf/llava-1.5-7b-hf", max_num_batched_tokens=100, disable_chunked_mm_input=True
        )


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_schedule_concurrent_partial_requests(enable_prefix_caching: bool):
    """Several long prefills RUNNING at once are scheduled together."""
    scheduler = create_scheduler(
        model="facebook/opt-125m",
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=400,
        enable_prefix_caching=enable_prefix_caching,
    )
    requests = create_requests(num_requests=3, num_tokens=800)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 3
    assert len(output.scheduled_cached_reqs) == 0
    assert len(output.finished_req_ids) == 0

    assert output.num_scheduled_tokens[requests[0].request_id] == 400
    assert output.num_scheduled_tokens[requests[1].request_id] == 400
    # 1024 - 400 - 400 = 224.
    assert output.num_scheduled_tokens[requests[2].request_id] == 224
    req_ids = [r.request_id for r in requests]
    scheduler.update_from_output(output, _runner_output(req_ids, [[] for _ in requests]))

    # All three running: the remaining prefills of the first two.
    output1 = scheduler.schedule()
    assert len(scheduler.running) == 3
    assert len(output1.scheduled_new_reqs) == 0
    assert len(output1.scheduled_cached_reqs) == 3
    assert len(output1.finished_req_ids) == 0
    assert output1.num_scheduled_tokens[requests[0].request_id] == 400
    assert output1.num_scheduled_tokens[requests[1].request_id] == 400
    assert output1.num_scheduled_tokens[requests[2].request_id] == 224

    # First and second decode; the third finishes its prompt.
    scheduler.update_from_output(output1, _runner_output(req_ids, [[0], [0]] + [[] for _ in range(len(requests) - 2)]))
    output2 = scheduler.schedule()
    assert len(scheduler.running) == 3
    assert len(output2.scheduled_new_reqs) == 0
    assert len(output2.scheduled_cached_reqs) == 3
    assert len(output2.finished_req_ids) == 0
    assert output2.num_scheduled_tokens[requests[0].request_id] == 1
    assert output2.num_scheduled_tokens[requests[1].request_id] == 1
    assert output2.num_scheduled_tokens[requests[2].request_id] == 800 - 224 - 224


def test_stop_via_update_from_output():
    """Stops applied by update_from_output: EOS, stop tokens, max_tokens, ignore_eos."""
    # Case 1: EOS.
    scheduler = create_scheduler()
    requests = create_requests(num_requests=2, max_tokens=10)
    _put_running(scheduler, requests)
    scheduler_output = _scheduler_output(
        {requests[0].request_id: 1, requests[1].request_id: 2},
        {requests[0].request_id: [], requests[1].request_id: [10]},
    )
    # The first request hits EOS, the second continues.
    model_output = _runner_output([r.request_id for r in requests], [[EOS_TOKEN_ID], [10, 11]])
    scheduler.update_from_output(scheduler_output, model_output)

    assert len(scheduler.running) == 1
    assert scheduler.running[0].request_id == requests[1].request_id
    assert requests[0].status == RequestStatus.FINISHED_STOPPED
    assert requests[0].request_id in scheduler.finished_req_ids
    assert list(requests[0].output_token_ids) == [EOS_TOKEN_ID]
    assert list(requests[1].output_token_ids) == [10, 11]

    # Case 2: a stop token.
    scheduler = create_scheduler()
    requests = create_requests(num_requests=2, max_tokens=10, stop_token_ids=[42, 43])
    _put_running(scheduler, requests)
    scheduler_output = _scheduler_output(
        {requests[0].request_id: 3, requests[1].request_id: 2},
        {requests[0].request_id: [10, 42], requests[1].request_id: [13]},
    )
    model_output = _runner_output([r.request_id for r in requests], [[10, 42, 12], [13, 14]])
    scheduler.update_from_output(scheduler_output, model_output)

    assert len(scheduler.running) == 1
    assert scheduler.running[0].request_id == requests[1].request_id
    assert requests[0].status == RequestStatus.FINISHED_STOPPED
    assert requests[0].stop_reason == 42
    assert requests[0].request_id in scheduler.finished_req_ids
    assert list(requests[0].output_token_ids) == [10, 42]
    assert list(requests[1].output_token_ids) == [13, 14]

    # Case 3: max_tokens.
    scheduler = create_scheduler()
    requests = create_requests(num_requests=2, max_tokens=2)
    _put_running(scheduler, requests)
    scheduler_output = _scheduler_output(
        {requests[0].request_id: 3, requests[1].request_id: 1},
        {requests[0].request_id: [10, 11], requests[1].request_id: []},
    )
    model_output = _runner_output([r.request_id for r in requests], [[10, 11, 12], [13]])
    scheduler.update_from_output(scheduler_output, model_output)

    assert len(scheduler.running) == 1
    assert scheduler.running[0].request_id == requests[1].request_id
    assert requests[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert requests[0].request_id in scheduler.finished_req_ids
    assert list(requests[0].output_token_ids) == [10, 11]  # truncated to max_tokens
    assert list(requests[1].output_token_ids) == [13]

    # Case 4: ignore_eos (SamplingParams are frozen here, so the request is built with it).
    scheduler = create_scheduler()
    requests = create_requests(num_requests=1, max_tokens=10, ignore_eos=True)
    assert requests[0].sampling_params.ignore_eos
    _put_running(scheduler, requests)
    scheduler_output = _scheduler_output({requests[0].request_id: 3}, {requests[0].request_id: [EOS_TOKEN_ID, 10]})
    model_output = _runner_output([requests[0].request_id], [[EOS_TOKEN_ID, 10, 11]])
    scheduler.update_from_output(scheduler_output, model_output)

    assert len(scheduler.running) == 1
    assert not requests[0].is_finished()
    assert list(requests[0].output_token_ids) == [EOS_TOKEN_ID, 10, 11]


@pytest.mark.parametrize("enable_prefix_caching, prompt_logprobs", [(None, None), (True, 5)])
def test_schedule_concurrent_batches(enable_prefix_caching, prompt_logprobs):
    scheduler = create_scheduler(
        max_num_batched_tokens=1024, max_num_seqs=2, enable_prefix_caching=enable_prefix_caching
    )
    requests = create_requests(num_requests=2, num_tokens=512, prompt_logprobs=prompt_logprobs)

    # Schedule the first request.
    scheduler.add_request(requests[0])
    scheduler_output0 = scheduler.schedule()
    assert len(scheduler_output0.scheduled_new_reqs) == 1
    assert scheduler_output0.num_scheduled_tokens[requests[0].request_id] == 512

    # The first request's step is in flight, so only the second is scheduled.
    scheduler.add_request(requests[1])
    scheduler_output1 = scheduler.schedule()
    assert len(scheduler_output1.scheduled_new_reqs) == 1
    assert scheduler_output1.num_scheduled_tokens[requests[1].request_id] == 512

    # Output of the first request.
    scheduler.update_from_output(scheduler_output0, _runner_output([requests[0].request_id], [[0]]))

    # The first request is scheduled again while the second is still in flight.
    scheduler_output2 = scheduler.schedule()
    assert scheduler_output2.num_scheduled_tokens[requests[0].request_id] == 1

    # Output of the second request.
    scheduler.update_from_output(scheduler_output1, _runner_output([requests[1].request_id], [[0]]))


# These cases mirror the rejection sampler's.
@pytest.mark.parametrize(
    "spec_tokens,output_tokens,expected",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], (3, 3)),  # perfect match
        ([[1, 2, 3]], [[1, 5]], (3, 1)),  # early mismatch
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (3, 3)),  # multiple sequences
        ([[1]], [[1, 2]], (1, 1)),  # single token sequence
        ([[]], [[5]], (0, 0)),  # empty sequence
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (6, 3)),  # multiple mismatches
    ],
)
def test_schedule_spec_decoding_stats(spec_tokens, output_tokens, expected):
    """Draft tokens are scheduled for verification; draft/accepted counts land in the stats."""
    scheduler = create_scheduler()
    requests = create_requests(num_requests=len(spec_tokens), num_tokens=1)
    req_ids = []
    for request in requests:
        scheduler.add_request(request)
        req_ids.append(request.request_id)

    # A first step, which also drafts speculative tokens.
    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == len(requests)
    assert output.total_num_scheduled_tokens == len(requests)
    for i in range(len(requests)):
        req_id = requests[i].request_id
        assert output.num_scheduled_tokens[req_id] == 1
        assert req_id not in output.scheduled_spec_decode_tokens

    model_runner_output = _runner_output(req_ids, [[0] for _ in range(len(requests))], spec_token_ids=spec_tokens)
    engine_core_outputs = scheduler.update_from_output(output, model_runner_output)

    for i in range(len(requests)):
        running_req = scheduler.running[i]
        # The prompt token.
        assert running_req.num_computed_tokens == 1
        # The prompt token and the sampled token.
        assert running_req.num_tokens == 2
        # Plus the drafts.
        assert running_req.num_tokens_with_spec == 2 + len(spec_tokens[i])

    # No draft or accepted tokens counted yet.
    assert engine_core_outputs.scheduler_stats.spec_decoding_stats is None

    # The drafts are scheduled for verification.
    output = scheduler.schedule()
    assert len(output.scheduled_new_reqs) == 0
    assert output.total_num_scheduled_tokens == len(requests) + sum(len(ids) for ids in spec_tokens)
    for i in range(len(requests)):
        req_id = requests[i].request_id
        assert output.num_scheduled_tokens[req_id] == 1 + len(spec_tokens[i])
        if spec_tokens[i]:
            assert len(output.scheduled_spec_decode_tokens[req_id]) == len(spec_tokens[i])
        else:
            assert req_id not in output.scheduled_spec_decode_tokens

    model_runner_output = _runner_output(req_ids, output_tokens)
    engine_core_outputs = scheduler.update_from_output(output, model_runner_output)

    scheduler_stats = engine_core_outputs.scheduler_stats
    if expected[0] == 0:
        assert scheduler_stats.spec_decoding_stats is None
    else:
        assert scheduler_stats.spec_decoding_stats is not None
        stats = scheduler_stats.spec_decoding_stats
        assert stats.num_draft_tokens == expected[0]
        assert stats.num_accepted_tokens == expected[1]


def _assert_right_scheduler_output(output: SchedulerOutput, num_requests: int, expected_num_scheduled_tokens: int):
    """The scheduler output after a remote KV hit."""
    # The connector's metadata is injected.
    assert len(output.kv_connector_metadata.requests) == num_requests
    # Only num_tokens - matched tokens are scheduled.
    for _, num_scheduled_tokens in output.num_scheduled_tokens.items():
        assert num_scheduled_tokens == expected_num_scheduled_tokens


def _assert_right_kv_cache_manager(
    scheduler: Scheduler, req_ids: list[str], num_tokens: int, block_size: int, num_requests: int, num_total_blocks: int
):
    """The KV-cache manager after allocation (through its own API)."""
    kv = scheduler.kv_cache_manager
    expected_actual_blocks = num_tokens // block_size
    expected_total_blocks = expected_actual_blocks + NUM_PREALLOCATE_BLOCKS
    for req_id in req_ids:
        blocks = kv.get_block_ids(req_id)
        hashes = scheduler.requests[req_id].block_hashes
        assert kv.get_num_cached_blocks(req_id) == expected_actual_blocks
        assert len(blocks) == expected_total_blocks
        assert len(hashes) == expected_actual_blocks

    # Every block was actually taken from the pool.
    blocks_per_req = num_tokens / block_size + NUM_PREALLOCATE_BLOCKS
    assert kv.block_pool.get_num_free_blocks() == num_total_blocks - num_requests * blocks_per_req


def _step_until_done(scheduler: Scheduler, output: SchedulerOutput, model_runner_output: ModelRunnerOutput):
    """schedule() / update_from_output() until every request finished."""
    all_finished = False
    _ = scheduler.update_from_output(output, model_runner_output)
    while not all_finished:
        output = scheduler.schedule()
        assert len(scheduler.running)
        for _, num_scheduled_tokens in output.num_scheduled_tokens.items():
            # Decoding now.
            assert num_scheduled_tokens == 1
        assert len(output.kv_connector_metadata.requests) == 0
        ecos = scheduler.update_from_output(output, model_runner_output)
        all_done = True
        for eco in ecos.outputs:
            if eco.finish_reason is None:
                all_done = False
        all_finished = all_done


def _mock_external_hit(scheduler: Scheduler, num_tokens: int) -> None:
    # The current connector API answers (count, load_async); a synchronous hit as in the spec.
    scheduler.connector.get_num_new_matched_tokens = Mock(name="method")
    scheduler.connector.get_num_new_matched_tokens.return_value = (num_tokens, False)


def test_kv_connector_basic():
    """With a connector: schedule, allocate and clean up under normal operation."""
    scheduler = create_scheduler(enable_prefix_caching=True, use_kv_connector=True)
    NUM_TOTAL_BLOCKS = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    BLOCK_SIZE = scheduler.cache_config.block_size

    NUM_MATCHED_NEW_TOKENS = BLOCK_SIZE * 2
    _mock_external_hit(scheduler, NUM_MATCHED_NEW_TOKENS)

    # First set of requests: external hit only.
    NUM_REQUESTS = 2
    NUM_TOKENS = NUM_MATCHED_NEW_TOKENS * 2
    MAX_TOKENS = 3
    requests = create_requests(num_requests=NUM_REQUESTS, num_tokens=NUM_TOKENS, max_tokens=MAX_TOKENS)
    req_ids = []
    for request in requests:
        scheduler.add_request(request)
        req_ids.append(request.request_id)
    MODEL_RUNNER_OUTPUT = _runner_output(req_ids, [[1000]] * len(req_ids))

    output = scheduler.schedule()
    _assert_right_scheduler_output(
        output=output,
        num_requests=NUM_REQUESTS,
        # Just the incremental tokens.
        expected_num_scheduled_tokens=NUM_TOKENS - NUM_MATCHED_NEW_TOKENS,
    )
    _assert_right_kv_cache_manager(scheduler, req_ids, NUM_TOKENS, BLOCK_SIZE, NUM_REQUESTS, NUM_TOTAL_BLOCKS)

    _step_until_done(scheduler, output, MODEL_RUNNER_OUTPUT)
    _ = scheduler.schedule()
    # Memory is cleaned up.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_TOTAL_BLOCKS

    # Second set: local and external hit. The first NUM_TOKENS_PREFIX tokens hit the local
    # prefix cache (used above).
    NUM_TOKENS_PREFIX = NUM_TOKENS
    NUM_TOKENS = NUM_TOKENS_PREFIX * 2
    requests = create_requests(num_requests=NUM_REQUESTS, num_tokens=NUM_TOKENS, max_tokens=MAX_TOKENS)
    req_ids = []
    for request in requests:
        scheduler.add_request(request)
        req_ids.append(request.request_id)
    MODEL_RUNNER_OUTPUT = _runner_output(req_ids, [[1000]] * len(req_ids))

    output = scheduler.schedule()
    _assert_right_scheduler_output(
        output=output,
        num_requests=NUM_REQUESTS,
        expected_num_scheduled_tokens=NUM_TOKENS - NUM_TOKENS_PREFIX - NUM_MATCHED_NEW_TOKENS,
    )
    _assert_right_kv_cache_manager(scheduler, req_ids, NUM_TOKENS, BLOCK_SIZE, NUM_REQUESTS, NUM_TOTAL_BLOCKS)

    _step_until_done(scheduler, output, MODEL_RUNNER_OUTPUT)
    _ = scheduler.schedule()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_TOTAL_BLOCKS


def test_kv_connector_unable_to_allocate():
    """With a connector, running out of blocks in allocate_slots() is handled."""
    BLOCK_SIZE = 4
    NUM_BLOCKS = 10
    scheduler = create_scheduler(
        enable_prefix_caching=True, use_kv_connector=True, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
    )
    NUM_MATCHED_NEW_TOKENS = BLOCK_SIZE * 2
    _mock_external_hit(scheduler, NUM_MATCHED_NEW_TOKENS)

    # The second request cannot get enough blocks.
    NUM_REQUESTS = 2
    NUM_TOKENS = (NUM_BLOCKS // 2 + 1) * BLOCK_SIZE
    MAX_TOKENS = 2
    requests = create_requests(num_requests=NUM_REQUESTS, num_tokens=NUM_TOKENS, max_tokens=MAX_TOKENS)
    req_ids = []
    for request in requests:
        scheduler.add_request(request)
        req_ids.append(request.request_id)
    MODEL_RUNNER_OUTPUT = _runner_output(req_ids, [[1000]] * len(req_ids))

    # Just one request runs.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=1, expected_num_scheduled_tokens=NUM_TOKENS - NUM_MATCHED_NEW_TOKENS)
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 1

    # All memory freed, one request waiting.
    _step_until_done(scheduler, output, MODEL_RUNNER_OUTPUT)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert len(scheduler.running) == 0
    assert len(scheduler.waiting) == 1

    # Now the other one runs.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=1, expected_num_scheduled_tokens=NUM_TOKENS - NUM_MATCHED_NEW_TOKENS)
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 0

    _step_until_done(scheduler, output, MODEL_RUNNER_OUTPUT)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert len(scheduler.running) == 0
    assert len(scheduler.waiting) == 0


def test_kv_connector_handles_preemption():
    """With a connector, a preempted request is rescheduled with local and remote hits."""
    BLOCK_SIZE = 2
    # One of them is the null block: 6 usable.
    NUM_BLOCKS = 7
    scheduler = create_scheduler(
        enable_prefix_caching=True, use_kv_connector=True, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
    )
    NUM_MATCHED_NEW_TOKENS = BLOCK_SIZE
    _mock_external_hit(scheduler, NUM_MATCHED_NEW_TOKENS)

    # Both start; the second is preempted and rescheduled.
    NUM_REQUESTS = 2
    NUM_TOKENS = BLOCK_SIZE * 2 + 1
    MAX_TOKENS = BLOCK_SIZE * 2
    requests = create_requests(num_requests=NUM_REQUESTS, num_tokens=NUM_TOKENS, max_tokens=MAX_TOKENS)
    req_ids = []
    for request in requests:
        scheduler.add_request(request)
        req_ids.append(request.request_id)
    MODEL_RUNNER_OUTPUT = _runner_output(req_ids, [[1000]] * len(req_ids))

    # Both scheduled - 1st token (2 remote hits).
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=2, expected_num_scheduled_tokens=NUM_TOKENS - NUM_MATCHED_NEW_TOKENS)
    assert len(scheduler.running) == 2
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)

    # Both scheduled - 2nd token.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=0, expected_num_scheduled_tokens=1)
    assert len(scheduler.running) == 2
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)

    # A new block is needed: preemption - 3rd token.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=0, expected_num_scheduled_tokens=1)
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 1
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 1

    # Only one scheduled - 4th (last) token.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=0, expected_num_scheduled_tokens=1)
    assert len(scheduler.waiting) == 1
    assert len(scheduler.running) == 1
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)
    assert len(scheduler.running) == 0
    assert len(scheduler.waiting) == 1
    # Nothing runs: all memory free.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1

    # The preempted request restarts - 3rd token, with a local and a remote hit.
    output = scheduler.schedule()
    _assert_right_scheduler_output(
        output,
        num_requests=1,
        # One block was preempted and there is one remote hit: one new token.
        expected_num_scheduled_tokens=1,
    )
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 0
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)
    assert len(scheduler.running) == 1
    assert len(scheduler.waiting) == 0

    # 4th (last) token.
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests=0, expected_num_scheduled_tokens=1)
    assert len(scheduler.running) == 1
    _ = scheduler.update_from_output(output, MODEL_RUNNER_OUTPUT)
    assert len(scheduler.running) == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


# ---- beyond the spec ------------------------------------------------------------------------------


def _run_to_completion(scheduler: Scheduler, token: int = 7, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[token] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
                   for r in ids]
        scheduler.update_from_output(out, _runner_output(ids, sampled))
    raise AssertionError("did not finish")


def test_add_request_validation():
    scheduler = create_scheduler(max_num_batched_tokens=64, max_model_len=64)
    (request,) = create_requests(num_requests=1)
    scheduler.add_request(request)
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(request)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(create_requests(num_requests=1, num_tokens=64, req_ids=["long"])[0])
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("0", RequestStatus.RUNNING)


def test_max_num_seqs_and_fcfs_order():
    scheduler = create_scheduler(max_num_seqs=3)
    requests = create_requests(num_requests=5, max_tokens=2)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["0", "1", "2"]
    scheduler.update_from_output(output, _runner_output(["0", "1", "2"], [[7], [7], [7]]))
    _run_to_completion(scheduler)
    assert all(r.num_output_tokens == 2 for r in requests)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 9999


def test_preempted_request_resumes_as_new_with_all_tokens():
    # 5 usable blocks of 4 tokens; two requests outgrow them and the later one is preempted.
    scheduler = create_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    requests = create_requests(num_requests=2, num_tokens=6, max_tokens=8)
    for request in requests:
        scheduler.add_request(request)
    resumed = None
    for _ in range(100):
        if not scheduler.has_requests():
            break
        out = scheduler.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"1"} and requests[1].status == RequestStatus.PREEMPTED
            assert scheduler.kv_cache_manager.get_block_ids("1") == []
        for new in out.scheduled_new_reqs:
            if new.req_id == "1" and requests[1].num_preemptions:
                resumed = new
        ids = list(out.num_scheduled_tokens)
        sampled = [[5] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
                   for r in ids]
        scheduler.update_from_output(out, _runner_output(ids, sampled))
    assert requests[1].num_preemptions >= 1 and resumed is not None
    # The resumed request re-sends its whole sequence, prompt plus the tokens it had generated.
    assert len(resumed.prefill_token_ids) > requests[1].num_prompt_tokens
    assert resumed.prefill_token_ids[:6] == [1] * 6
    assert len(resumed.block_ids) * 4 >= resumed.num_computed_tokens + out.num_scheduled_tokens.get("1", 0)
    assert all(r.num_output_tokens == 8 for r in requests)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 5


def test_reset_prefix_cache():
    scheduler = create_scheduler(enable_prefix_caching=True)
    requests = create_requests(num_requests=2, num_tokens=40, max_tokens=3)
    for request in requests:
        scheduler.add_request(request)
    scheduler.update_from_output(out := scheduler.schedule(), _runner_output(list(out.num_scheduled_tokens), [[7], [7]]))
    assert scheduler.reset_prefix_cache() is False  # blocks in use
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert all(r.status == RequestStatus.PREEMPTED for r in requests)
    assert scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"0", "1"}
    # Resumed with their whole sequence, nothing cached any more.
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {"0": 0, "1": 0}
    assert out.num_scheduled_tokens == {"0": 41, "1": 41}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_sync_kv_load_failure(policy):
    scheduler = create_scheduler(enable_prefix_caching=True, use_kv_connector=True, block_size=4)
    scheduler.kv_load_failure_policy = type(scheduler.kv_load_failure_policy)(policy)
    _mock_external_hit(scheduler, 8)
    (request,) = create_requests(num_requests=1, num_tokens=12, max_tokens=3)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 4}
    bad_block = scheduler.kv_cache_manager.get_block_ids("0")[1]
    runner_out = _runner_output(["0"], [[7]])
    runner_out.kv_connector_output = KVConnectorOutput(invalid_block_ids={bad_block})
    result = scheduler.update_from_output(out, runner_out)
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert [o.finish_reason for o in result.outputs] == [FinishReason.ERROR]
    else:
        # The token sampled on bad KV is dropped; recomputed from the first bad block (the good
        # first block is still a prefix hit).
        assert request.num_output_tokens == 0 and request.status == RequestStatus.PREEMPTED
        scheduler.connector.get_num_new_matched_tokens.return_value = (0, False)
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {"0": 8}
        assert out.scheduled_new_reqs[0].num_computed_tokens == 4
        scheduler.update_from_output(out, _runner_output(["0"], [[7]]))
        _run_to_completion(scheduler)
        assert request.num_output_tokens == 3
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 9999


def test_scheduler_eos_default_and_stats():
    scheduler = create_scheduler()
    from shared.engine.request import Request, SamplingParams

    request = Request("x", [5, 6, 7], SamplingParams(max_tokens=10), eos_token_id=None)
    scheduler.add_request(request)
    assert request.eos_token_id == EOS_TOKEN_ID
    out = scheduler.schedule()
    result = scheduler.update_from_output(out, _runner_output(["x"], [[EOS_TOKEN_ID]]))
    assert result.outputs[0].finish_reason == FinishReason.STOP and result.outputs[0].stop_reason is None
    stats = result.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    assert result.finished_requests == {"x"}


def test_config_validation():
    from shared.engine.sched_config import CacheConfig, SchedulerConfig

    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_mm_input_tokens"):
        SchedulerConfig(max_num_batched_tokens=100, disable_chunked_mm_input=True, max_mm_input_tokens=576)
    with pytest.raises(ValueError, match="speculative_method"):
        SchedulerConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)
    assert SchedulerConfig(max_num_batched_tokens=512).encoder_budget == 512
