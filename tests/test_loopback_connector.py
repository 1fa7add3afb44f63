"""Producer -> consumer KV handoff at the scheduler level through the in-process loopback connector:
holds, WAITING_FOR_REMOTE_KVS, block copies, lease expiry, load-failure policies, no leaks."""
from __future__ import annotations

import pytest
import torch

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.kv_transfer.handoff import HoldForPeer
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy, KVRole
from loopback_connector import LoopbackConnector, LoopbackHandle, LoopbackKVStore
from shared.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from shared.engine.sched.async_scheduler import AsyncScheduler
from shared.engine.sched.output import KVConnectorOutput, ModelRunnerOutput
from shared.engine.sched.scheduler import Scheduler

BLOCK = 16
NUM_BLOCKS = 12
EOS = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """One engine: scheduler + connector + a fake runner whose sampled token depends only on the
    position (so a split run and a colocated run agree), and a fake KV cache per block."""

    def __init__(self, role: KVRole, store: LoopbackKVStore, engine_id: str, policy=KVLoadFailurePolicy.RECOMPUTE,
                 eos_at: int | None = None, async_scheduling: bool = False, num_blocks: int = NUM_BLOCKS) -> None:
        self.connector = LoopbackConnector(role, store, engine_id, BLOCK, lease_s=10.0, load_failure_policy=policy)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
            CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
            connector=self.connector,
            eos_token_id=EOS,
        )
        # One "layer": a value per slot, so copies are visible.
        self.kv = torch.zeros(num_blocks, BLOCK, dtype=torch.int64)
        self.connector.register_kv_caches({"layer0": self.kv})
        self.eos_at = eos_at
        self.outputs: dict[str, list] = {}

    def token_at(self, position: int) -> int:
        return EOS if position == self.eos_at else 100 + position

    def step(self):
        sched = self.scheduler
        out = sched.schedule()
        self.connector.start_load_kv(out.kv_connector_metadata)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            req = sched.requests[req_id]
            block_ids = sched.kv_cache_manager.get_block_ids(req_id)
            start = req.num_computed_tokens - out.num_scheduled_tokens[req_id]
            for pos in range(start, req.num_computed_tokens):  # "compute" KV: slot value = token at pos
                self.kv[block_ids[pos // BLOCK], pos % BLOCK] = req.all_token_ids[pos]
            sampled.append([self.token_at(req.num_tokens)] if req.num_computed_tokens >= req.num_tokens else [])
        sending, recving = self.connector.get_finished(out.finished_req_ids)
        runner_out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving,
                invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
            ),
        )
        result = sched.update_from_output(out, runner_out)
        for o in result.outputs:
            self.outputs.setdefault(o.request_id, []).append(o)
        return out, result

    def used_blocks(self) -> int:
        return self.scheduler.get_kv_usage().num_used_blocks


def _prompt(n: int, base: int = 0) -> list[int]:
    return [base + 3 + i for i in range(n)]


def _prefill(producer: Engine, req_id: str, prompt: list[int], max_tokens: int = 6) -> tuple[int, LoopbackHandle | None]:
    producer.scheduler.add_request(
        Request(req_id, prompt, SamplingParams(max_tokens=1), EOS,
                kv_transfer_params=HoldForPeer() if max_tokens > 1 else None)
    )
    for _ in range(10):
        _, result = producer.step()
        for o in result.outputs:
            if o.request_id == req_id and o.finished:
                return o.new_token_ids[0], o.kv_handle
    raise AssertionError("prefill did not finish")


def _decode(consumer: Engine, req_id: str, prompt: list[int], token1: int, handle: LoopbackHandle | None, max_tokens: int = 6):
    consumer.scheduler.add_request(
        Request(req_id, prompt + [token1], SamplingParams(max_tokens=max_tokens - 1), EOS,
                kv_transfer_params=handle)
    )


def _run_until_idle(*engines: Engine, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        busy = False
        for engine in engines:
            sched = engine.scheduler
            if sched.has_requests() or sched.num_held_requests or engine.connector.store.num_holds(engine.connector.engine_id):
                engine.step()
                busy = True
        if not busy:
            return
    raise AssertionError("engines did not go idle")


def _tokens(engine: Engine, req_id: str) -> list[int]:
    return [t for o in engine.outputs.get(req_id, []) for t in o.new_token_ids]


def test_handoff_pulls_blocks_and_matches_colocated_run():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P")
    consumer = Engine(KVRole.CONSUMER, store, "C")
    prompt = _prompt(40)

    token1, handle = _prefill(producer, "r", prompt)
    assert token1 == 100 + 40
    assert handle.engine_id == "P" and handle.num_tokens == 40
    assert len(list(handle.block_ids)) == 3
    # Blocks stay held for the peer.
    assert producer.used_blocks() == 3 and producer.scheduler.num_held_requests == 1
    assert producer.scheduler.get_kv_usage().num_held_blocks == 3
    assert producer.scheduler.get_num_unfinished_requests() == 0

    _decode(consumer, "r", prompt, token1, handle)
    out, _ = consumer.step()
    request = consumer.scheduler.requests["r"]
    assert out.num_scheduled_tokens == {}  # waiting for the pull
    assert len(out.kv_connector_metadata.requests) == 1
    load = out.kv_connector_metadata.requests[0]
    assert load.remote_block_ids == list(handle.block_ids) and len(load.local_block_ids) == 3
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or request.status == RequestStatus.WAITING
    # The pulled slots hold the producer's KV.
    for remote, local in zip(load.remote_block_ids, load.local_block_ids):
        assert torch.equal(consumer.kv[local], producer.kv[remote])

    out, _ = consumer.step()
    # Only token 1 is computed locally: the prompt's 40 tokens came from the producer.
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 40

    _run_until_idle(producer, consumer)
    # Same tokens as a colocated run (the fake runner samples by position).
    assert _tokens(consumer, "r") == [100 + p for p in range(41, 46)]
    assert consumer.outputs["r"][-1].finish_reason == FinishReason.LENGTH
    # The producer freed its blocks once the consumer released them; nothing leaks anywhere.
    assert producer.used_blocks() == 0 and consumer.used_blocks() == 0
    assert producer.scheduler.num_held_requests == 0 and store.num_holds() == 0


def test_consumer_prefix_hit_pulls_only_missing_blocks():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P")
    consumer = Engine(KVRole.CONSUMER, store, "C")
    prompt = _prompt(40)
    # The consumer computed the first two blocks itself earlier.
    consumer.scheduler.add_request(Request("warm", prompt[:33], SamplingParams(max_tokens=1), EOS))
    _run_until_idle(consumer)

    token1, handle = _prefill(producer, "r", prompt)
    _decode(consumer, "r", prompt, token1, handle)
    out, _ = consumer.step()
    (load,) = out.kv_connector_metadata.requests
    assert load.remote_block_ids == list(handle.block_ids)[2:]
    _run_until_idle(producer, consumer)
    assert _tokens(consumer, "r") == [100 + p for p in range(41, 46)]
    assert producer.used_blocks() == 0 and consumer.used_blocks() == 0


def test_token1_stop_frees_producer_blocks_at_once():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P", eos_at=40)
    token1, handle = _prefill(producer, "r", _prompt(40))
    assert token1 == EOS and handle is None
    assert producer.used_blocks() == 0 and store.num_holds() == 0


@pytest.mark.parametrize("policy", [KVLoadFailurePolicy.RECOMPUTE, KVLoadFailurePolicy.FAIL])
def test_expired_lease_recomputes_or_fails(policy):
    clock = FakeClock()
    store = LoopbackKVStore(clock=clock)
    producer = Engine(KVRole.PRODUCER, store, "P")
    consumer = Engine(KVRole.CONSUMER, store, "C", policy=policy)
    prompt = _prompt(40)
    token1, handle = _prefill(producer, "r", prompt)
    clock.now += 60.0  # the lease ran out before the pull
    producer.step()
    assert producer.used_blocks() == 0  # expired hold freed on the producer

    _decode(consumer, "r", prompt, token1, handle)
    consumer.step()  # the pull fails: its blocks are reported invalid
    if policy == KVLoadFailurePolicy.FAIL:
        assert consumer.outputs["r"][-1].finish_reason == FinishReason.ERROR
        assert "r" not in consumer.scheduler.requests
    else:
        out, _ = consumer.step()
        # Recomputed locally from the first bad block (here: all of the prompt).
        assert out.num_scheduled_tokens == {"r": 41}
        _run_until_idle(producer, consumer)
        assert _tokens(consumer, "r") == [100 + p for p in range(41, 46)]
    assert consumer.used_blocks() == 0


def test_abort_while_loading_frees_after_the_load():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P")
    consumer = Engine(KVRole.CONSUMER, store, "C")
    prompt = _prompt(40)
    token1, handle = _prefill(producer, "r", prompt)
    _decode(consumer, "r", prompt, token1, handle)
    sched = consumer.scheduler
    # Schedule the pull, abort before its completion is reported.
    out = sched.schedule()
    assert sched.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert consumer.used_blocks() == 3  # the load may still be writing into them
    consumer.connector.start_load_kv(out.kv_connector_metadata)
    sending, recving = consumer.connector.get_finished(set())
    sched.update_from_output(
        out, ModelRunnerOutput([], {}, [], kv_connector_output=KVConnectorOutput(sending, recving))
    )
    assert consumer.used_blocks() == 0
    _run_until_idle(producer)
    assert producer.used_blocks() == 0


def test_async_consumer_and_producer_roles():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P", async_scheduling=True)
    consumer = Engine(KVRole.CONSUMER, store, "C", async_scheduling=True)
    assert producer.scheduler.requires_kv_delivery and not consumer.scheduler.requires_kv_delivery
    prompts = {f"r{i}": _prompt(20 + 7 * i, base=50 * i) for i in range(3)}
    for req_id, prompt in prompts.items():
        token1, handle = _prefill(producer, req_id, prompt)
        _decode(consumer, req_id, prompt, token1, handle)
    _run_until_idle(producer, consumer)
    for req_id, prompt in prompts.items():
        n = len(prompt)
        assert _tokens(consumer, req_id) == [100 + p for p in range(n + 1, n + 6)]
    assert producer.used_blocks() == 0 and consumer.used_blocks() == 0


def test_release_held_frees_without_the_peer():
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P")
    _prefill(producer, "r", _prompt(40))
    assert producer.scheduler.num_held_requests == 1
    assert producer.scheduler.release_held(["nope"]) == set()
    assert producer.scheduler.release_held() == {"r"}
    assert producer.used_blocks() == 0 and producer.scheduler.num_held_requests == 0
    # A late finished_sending for it is harmless.
    store.release("P", "r")
    producer.step()
    assert producer.used_blocks() == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_handoffs_under_pressure_leak_nothing(seed):
    """Small pools on both sides (preemption, waiting for blocks), random lengths and aborts:
    every request ends, completed ones carry the colocated tokens, and no block stays used."""
    import random

    rng = random.Random(seed)
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P", async_scheduling=seed % 2 == 1)
    consumer = Engine(KVRole.CONSUMER, store, "C", async_scheduling=seed % 2 == 0, num_blocks=8)
    prompts = {f"r{i}": _prompt(rng.randrange(5, 40), base=rng.choice([0, 0, 200])) for i in range(12)}
    max_tokens = {req_id: rng.randrange(1, 40) for req_id in prompts}
    pending = list(prompts)
    submitted: set[str] = set()
    aborted: set[str] = set()
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            req_id = pending.pop(0)
            producer.scheduler.add_request(
                Request(req_id, prompts[req_id], SamplingParams(max_tokens=1), EOS,
                        kv_transfer_params=HoldForPeer() if max_tokens[req_id] > 1 else None)
            )
        for o in [o for outs in producer.outputs.values() for o in outs if o.finished]:
            if o.request_id not in submitted and o.kv_handle:
                submitted.add(o.request_id)
                _decode(consumer, o.request_id, prompts[o.request_id], o.new_token_ids[0], o.kv_handle,
                        max_tokens=max_tokens[o.request_id])
        if consumer.scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(consumer.scheduler.requests))
            consumer.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        idle = not pending
        for engine in (producer, consumer):
            sched = engine.scheduler
            if sched.has_requests() or sched.num_held_requests or store.num_holds(engine.connector.engine_id):
                engine.step()
                idle = False
        if idle:
            break
    else:
        raise AssertionError("did not go idle")
    for req_id, prompt in prompts.items():
        n = len(prompt)
        if max_tokens[req_id] == 1:
            assert req_id not in submitted
        elif req_id not in aborted:
            assert _tokens(consumer, req_id) == [100 + p for p in range(n + 1, n + max_tokens[req_id])]
    assert producer.used_blocks() == 0 and consumer.used_blocks() == 0 and store.num_holds() == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_head_request_that_does_not_fit_does_not_block_landed_pulls_behind_it(async_scheduling):
    """The decode pod wedge of issue 26's second run: the only running request is preempted (to the head of the
    waiting queue) because pulls admitted behind it took the free blocks; it then needs more blocks than are free,
    and the pulled requests that hold the rest sit behind it. Stopping the waiting pass at the head left them
    there for good (0 running, blocks used, nothing logged). Requests that already hold their blocks must pass it."""
    store = LoopbackKVStore()
    producer = Engine(KVRole.PRODUCER, store, "P", num_blocks=64)
    consumer = Engine(KVRole.CONSUMER, store, "C", num_blocks=NUM_BLOCKS, async_scheduling=async_scheduling)
    sched = consumer.scheduler
    long_prompt = _prompt(40)
    token1, handle = _prefill(producer, "long", long_prompt)
    _decode(consumer, "long", long_prompt, token1, handle, max_tokens=100)
    consumer.step()
    consumer.step()
    assert [r.request_id for r in sched.running] == ["long"]
    # Two pulls admitted behind it; their READs land only later (the confirmation under way).
    held_back = []
    real_start_load_kv = consumer.connector.start_load_kv
    consumer.connector.start_load_kv = held_back.append
    for req_id in ("b", "c"):
        prompt = _prompt(40, base=100 * (ord(req_id) - ord("a")))
        token1, handle = _prefill(producer, req_id, prompt)
        _decode(consumer, req_id, prompt, token1, handle, max_tokens=3)
    for _ in range(100):
        consumer.step()
        if not sched.running:
            break
    assert not sched.running and sched.waiting[0].request_id == "long"  # preempted to the head
    consumer.connector.start_load_kv = real_start_load_kv
    for metadata in held_back:
        real_start_load_kv(metadata)
    _run_until_idle(producer, consumer, max_steps=400)
    for req_id in ("b", "c"):
        assert _tokens(consumer, req_id) == [100 + 41, 100 + 42]  # recomputed or pulled, the colocated tokens
    assert _tokens(consumer, "long") == [100 + p for p in range(41, 140)]
    assert consumer.used_blocks() == 0 and producer.used_blocks() == 0
