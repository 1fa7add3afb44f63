"""KV-cache manager: prefix hits, allocation, caching of known tokens only, freeing order,
invalidation, and no leaked blocks after whole scheduler scenarios."""
from __future__ import annotations

import random

import pytest

from sched_utils import create_scheduler
from shared.engine.kv_cache.manager import KVCacheManager
from shared.engine.request import PlaceholderRange, Request, RequestStatus, SamplingParams
from shared.engine.sched.output import ModelRunnerOutput

BLOCK = 4


def _manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, max_model_len=1024, enable_caching=caching)


def _request(req_id: str, tokens: list[int], **kwargs) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=kwargs.pop("prompt_logprobs", None))
    return Request(req_id, tokens, params, eos_token_id=None, **kwargs)


def _prefill(kv: KVCacheManager, request: Request) -> list[int]:
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = _manager()
    a = _request("a", list(range(10)))
    blocks_a = _prefill(kv, a)
    assert len(blocks_a) == 3 and kv.get_num_cached_blocks("a") == 2  # 2 full blocks
    b = _request("b", list(range(10)) + [99, 98])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [blk.block_id for blk in hits] == blocks_a[:2]
    kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert kv.get_block_ids("b")[:2] == blocks_a[:2]
    assert all(blk.ref_cnt == 2 for blk in hits)
    # A prompt that is exactly the cached blocks still computes its last token (one block less).
    c = _request("c", list(range(8)))
    assert kv.get_computed_blocks(c)[1] == 4


def test_allocation_failure_changes_nothing():
    kv = _manager(num_blocks=4)  # 3 usable
    a = _request("a", list(range(8)))
    _prefill(kv, a)
    kv.free(a)  # both blocks free but cached
    b = _request("b", list(range(8)) + [50] * 8)  # hits 2 cached blocks, needs 2 more
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    free_before = kv.get_num_free_blocks()
    assert kv.allocate_slots(b, 8, num_hit, hits) is None
    assert kv.get_num_free_blocks() == free_before and all(h.ref_cnt == 0 for h in hits)
    assert kv.get_block_ids("b") == []


def test_free_evicts_the_tail_first():
    kv = _manager(num_blocks=5)  # 4 usable
    a = _request("a", list(range(13)))
    blocks_a = _prefill(kv, a)  # 4 blocks, 3 cached
    kv.free(a)
    assert kv.block_pool.free_block_ids()[:4] == list(reversed(blocks_a))
    # A new request taking one block gets a's uncached tail block: all three full blocks stay cached.
    other = _request("o", [500] * 3)
    _prefill(kv, other)
    again = _request("a2", list(range(13)))
    assert kv.get_computed_blocks(again)[1] == 12
    kv.free(other)
    assert kv.block_pool.free_block_ids() == list(reversed(blocks_a[:3])) + kv.block_pool.free_block_ids()[3:]
    x = _request("x", [600] * 3)
    _prefill(kv, x)  # one block: a's third full block goes first, the first two stay cached
    assert kv.get_computed_blocks(_request("a3", list(range(13))))[1] == 8


def test_only_known_tokens_are_cached():
    kv = _manager()
    a = _request("a", list(range(6)))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    # Async: two steps booked ahead of tokens the scheduler has not seen yet.
    kv.allocate_slots(a, 2)
    a.num_computed_tokens = 8
    assert kv.get_num_cached_blocks("a") == 1
    a.append_output_token_ids([6, 7])
    kv.allocate_slots(a, 1)
    assert kv.get_num_cached_blocks("a") == 2
    assert len(a.block_hashes) == 2


def test_delay_cache_blocks_until_cache_blocks():
    kv = _manager()
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 0, num_external_computed_tokens=11, delay_cache_blocks=True) is not None
    assert kv.get_num_cached_blocks("a") == 0 and kv.get_num_blocks("a") == 3
    kv.cache_blocks(a, 11)
    assert kv.get_num_cached_blocks("a") == 2


def test_prompt_logprobs_and_disabled_caching_skip_the_cache():
    kv = _manager()
    _prefill(kv, _request("a", list(range(12))))
    assert kv.get_computed_blocks(_request("b", list(range(12)), prompt_logprobs=1)) == ([], 0)
    off = _manager(caching=False)
    _prefill(off, _request("a", list(range(12))))
    assert off.get_computed_blocks(_request("b", list(range(12)))) == ([], 0)
    assert off.block_pool.num_cached_blocks == 0


def test_extra_keys_separate_equal_tokens():
    kv = _manager()
    mm = [PlaceholderRange(offset=2, length=4)]
    _prefill(kv, _request("a", list(range(12)), mm_positions=mm, mm_hashes=["img-1"]))
    assert kv.get_computed_blocks(_request("b", list(range(12)), mm_positions=mm, mm_hashes=["img-2"]))[1] == 0
    assert kv.get_computed_blocks(_request("c", list(range(12)), mm_positions=mm, mm_hashes=["img-1"]))[1] == 8
    # The image spans blocks 0 and 1 only: block 2 differs because its parent differs.
    _prefill(kv, _request("s", list(range(12)), cache_salt="tenant-a"))
    assert kv.get_computed_blocks(_request("t", list(range(12)), cache_salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(_request("u", list(range(12)), cache_salt="tenant-a"))[1] == 8


def test_invalidate_blocks_uncaches_from_first_bad():
    kv = _manager()
    a = _request("a", list(range(13)))
    blocks = _prefill(kv, a)
    assert kv.invalidate_blocks(a, {blocks[1]}) == 1
    assert kv.get_num_cached_blocks("a") == 1
    assert kv.get_computed_blocks(_request("b", list(range(13))))[1] == 4
    assert kv.invalidate_blocks(a, {12345}) is None


def test_usage_snapshot():
    kv = _manager(num_blocks=9)
    a = _request("a", list(range(9)))
    _prefill(kv, a)
    usage = kv.get_usage()
    assert (usage.num_total_blocks, usage.num_used_blocks, usage.num_free_blocks) == (8, 3, 5)
    assert usage.usage == pytest.approx(3 / 8)
    kv.free(a)
    assert kv.get_usage().num_used_blocks == 0 and kv.get_usage().num_cached_blocks == 2


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_leaked_blocks_after_random_scenario(seed: int, async_scheduling: bool):
    """Random prompts (shared prefixes), tight pool (preemption), aborts, stop tokens, drafts:
    at the end every block is free and every request finished."""
    rng = random.Random(seed)
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        async_scheduling=async_scheduling,
        num_speculative_tokens=2 if async_scheduling and seed % 2 else None,
        speculative_method="ngram" if async_scheduling and seed % 2 else None,
    )
    requests = []
    for i in range(20):
        prefix = [7] * rng.choice([0, 4, 8, 12])
        prompt = prefix + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(1, 12), stop_token_ids=[13])
        requests.append(Request(f"r{i}", prompt, params, eos_token_id=None))
    pending = list(requests)
    in_flight = []
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.finish_requests(rng.choice(list(scheduler.requests)), RequestStatus.FINISHED_ABORTED)
        if not pending and not scheduler.has_requests() and not in_flight:
            break
        if scheduler.has_requests():
            in_flight.append(scheduler.schedule())
        if in_flight and (len(in_flight) > (2 if async_scheduling else 0) or not scheduler.has_requests()):
            out = in_flight.pop(0)
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for req_id in ids:
                drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
                sampled.append([rng.randrange(1, 60) for _ in range(1 + rng.randrange(0, len(drafts) + 1))])
            scheduler.update_from_output(
                out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=sampled)
            )
    else:
        raise AssertionError(f"scenario did not finish: {list(scheduler.requests.values())}")
    assert all(r.is_finished() for r in requests)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 23
    assert scheduler.get_kv_usage().num_used_blocks == 0
    assert all(r.num_output_tokens <= r.max_tokens for r in requests)
