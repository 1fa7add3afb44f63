"""KV events keep a router's index exact: a real pod's block pool stores and evicts blocks, its event
feed streams the changes, and every index that follows it holds exactly the pool's cached hashes; a late
subscriber starts from a snapshot, and a restarted pod (new engine id) replaces the old one's entries."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from router.kv_index import KvIndex, PromptHashes
from shared.engine.kv_cache.events import KvEvent, KvEventKind, KvEventLog
from shared.engine.kv_cache.manager import KVCacheManager
from shared.engine.request import Request, SamplingParams
from shared.serving.wire.kv_events import kv_event_update_from_proto, kv_event_update_to_proto
from shared.serving.pod.kv_events import KvEventFeed
from shared.serving.pod.runtime import Pod, PodConfig
from shared.serving.wire.payloads import KvEventUpdate

BLOCK_SIZE = 4
ADDRESS = "10.0.0.1:50071"


def _pod() -> Pod:
    # 16 usable blocks: a handful of 20-40 token requests already forces evictions.
    defaults = PodConfig()
    pod = Pod(None, PodConfig(
        model="tiny",
        max_model_len=64,
        cache=dataclasses.replace(defaults.cache, block_size=BLOCK_SIZE, num_blocks=17),
    ))
    pod.start()
    return pod


def _pool(pod: Pod):
    return pod.engine.scheduler.kv_cache_manager.block_pool


async def _pool_hashes(pod: Pod) -> set[bytes]:
    return set(await pod.loop.call(lambda _engine: _pool(pod).cached_hashes()))


async def _run(pod: Pod, request_id: str, prompt: list[int]) -> None:
    request = Request(request_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=None)
    async for _ in pod.submit(request):
        pass


async def _follow(feed: KvEventFeed, *indexes: KvIndex) -> None:
    async for update in feed.subscribe():
        # Through the wire format, as a router receives it.
        update = kv_event_update_from_proto(kv_event_update_to_proto(update))
        for index in indexes:
            index.apply(ADDRESS, update)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "the index did not catch up with the pool"
        await asyncio.sleep(0.01)


@pytest.mark.e2e  # runs real engines (in-process)
def test_index_follows_store_evict_snapshot_and_restart():
    async def scenario() -> None:
        rng = random.Random(7)
        pod = _pod()
        feed = KvEventFeed(pod)
        index, replica, late = KvIndex(), KvIndex(), KvIndex()
        followers = [asyncio.ensure_future(_follow(feed, index, replica))]

        async def exact(*indexes: KvIndex):
            async def check() -> bool:
                held = await _pool_hashes(pod)
                return all(i.hashes(ADDRESS) == held and i.engine_id(ADDRESS) == pod.engine_id for i in indexes)
            return check

        system = [rng.randrange(3, 4000) for _ in range(12)]
        for turn in range(12):
            prompt = system + [rng.randrange(3, 4000) for _ in range(rng.randrange(5, 28))]
            await _run(pod, f"r{turn}", prompt)
            await _until(await exact(index, replica))
            if turn == 5:
                followers.append(asyncio.ensure_future(_follow(feed, late)))
                await _until(await exact(late))
        assert _pool(pod).num_evictions > 0, "the scenario must evict"
        await _until(await exact(index, replica, late))
        assert index.hashes(ADDRESS) and feed.num_subscribers == 2

        # The pod restarts: its successor (a new engine id) streams into the same address.
        restarted = _pod()
        feed_after = KvEventFeed(restarted)
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        assert feed.num_subscribers == 0
        await pod.stop()
        followers = [asyncio.ensure_future(_follow(feed_after, index))]
        await _run(restarted, "after", system + [9, 9, 9, 9, 9])
        pod = restarted
        await _until(await exact(index))
        assert index.engine_id(ADDRESS) == restarted.engine_id
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        await restarted.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))


@pytest.mark.e2e
def test_the_pool_hook_is_off_without_subscribers():
    async def scenario() -> None:
        pod = _pod()
        feed = KvEventFeed(pod)
        assert _pool(pod).event_log is None
        updates = feed.subscribe()
        first = await updates.__anext__()
        assert first.is_snapshot and _pool(pod).event_log is not None
        await updates.aclose()
        await pod.loop.call(lambda _engine: None)  # the detach command ran before this one
        assert _pool(pod).event_log is None and feed.num_subscribers == 0
        await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_router_hashes_prompts_like_the_pod():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE, max_model_len=256, hash_seed="deployment-7")
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks, the last one ends before the last token
    request = Request("r", prompt, SamplingParams(max_tokens=2), eos_token_id=None)
    pod_hashes = manager.update_block_hashes(request)
    router_hashes = PromptHashes(prompt).for_layout(BLOCK_SIZE, manager.root_hash)
    assert router_hashes == pod_hashes[:5]
    # A prompt of exactly 5 blocks: the pod computes its last block to sample, so only 4 count.
    assert len(PromptHashes(prompt[:20]).for_layout(BLOCK_SIZE, manager.root_hash)) == 4


def test_index_counts_the_leading_cached_run_and_applies_removals():
    root = bytes(32)
    prompt = PromptHashes(list(range(1, 18)))  # 4 countable blocks of 4
    hashes = prompt.for_layout(BLOCK_SIZE, root)
    index = KvIndex()
    stored = [KvEvent(KvEventKind.STORED, h) for h in hashes]
    index.apply(ADDRESS, KvEventUpdate("e1", BLOCK_SIZE, root, True, stored[:3]))
    assert index.cached_tokens(ADDRESS, prompt) == 12
    index.apply(ADDRESS, KvEventUpdate("e1", BLOCK_SIZE, root, False, [KvEvent(KvEventKind.REMOVED, hashes[1])]))
    assert index.cached_tokens(ADDRESS, prompt) == 4  # a hole ends the usable prefix
    index.apply(ADDRESS, KvEventUpdate("e1", BLOCK_SIZE, root, False, [KvEvent(KvEventKind.CLEARED)]))
    assert index.cached_tokens(ADDRESS, prompt) == 0 and index.engine_id(ADDRESS) == "e1"
    index.apply(ADDRESS, KvEventUpdate("e1", BLOCK_SIZE, root, False, stored))
    index.apply(ADDRESS, KvEventUpdate("e2", BLOCK_SIZE, root, False, []))  # restarted: nothing known
    assert index.cached_tokens(ADDRESS, prompt) == 0
    index.forget(ADDRESS)
    assert index.engine_id(ADDRESS) is None


def test_index_and_event_log_are_bounded():
    index = KvIndex(max_blocks_per_pod=2)
    events = [KvEvent(KvEventKind.STORED, bytes([i]) * 32) for i in range(5)]
    index.apply(ADDRESS, KvEventUpdate("e", BLOCK_SIZE, bytes(32), True, events))
    assert len(index.hashes(ADDRESS)) == 2 and index.num_dropped_stores == 3
    log = KvEventLog(max_pending=2)
    for event in events:
        log.record(event.kind, event.block_hash)
    batch = log.take()
    assert len(batch.events) == 2 and batch.overflowed
    assert log.take() == type(batch)([], False)


@pytest.mark.parametrize("message, error", [
    (dict(engine_id="", block_size=4, root_hash=bytes(32)), "engine_id is empty"),
    (dict(engine_id="e", block_size=0, root_hash=bytes(32)), "block_size"),
    (dict(engine_id="e", block_size=4, root_hash=b"x"), "root_hash must be 32 bytes"),
])
def test_bad_event_messages_are_refused(message, error):
    from proto.pdserve.v1 import kv_events_pb2

    with pytest.raises(ValueError, match=error):
        kv_event_update_from_proto(kv_events_pb2.SubscribeKvEventsResponse(**message))
