"""The router's Generate over real gRPC on 127.0.0.1 against small fake prefill/decode servers: token 1
first, decode relay, retries, re-issue without duplicates, deadlines, cancellation, errors, text."""
import asyncio
import dataclasses
import signal
import sys
from pathlib import Path

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import AsyncPdserveClient, PdserveClient
from proto.pdserve.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from router.flags import PoolConfig, RouterConfig, WorkerSpec, parse_worker_spec
from router.metrics import RouterMetrics
from router.servicer import RouterServicer
from prometheus_client import CollectorRegistry
from shared.serving.generation import GenerateInput
from shared.engine.request import SamplingParams
from shared.serving.text import TextCodec
from router.workers import WorkerPool, resolve_dns
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullOutcome, KvPullStats
from shared.serving.wire.decode import decode_chunk_to_proto, decode_request_from_proto
from shared.serving.wire.prefill import prefill_request_from_proto, prefill_result_to_proto
from shared.serving.wire import payloads as wire
from shared.serving.pod.outcomes import RETRY_AFTER_KEY
from shared.serving.server.grpc_server import GrpcServer, ServerOptions
from shared.serving.prefill_client import PrefillClient
from shared.engine.model.generation_config import GenerationDefaults
from shared.engine.request import FinishReason

REPO = Path(__file__).resolve().parents[1]
LAYOUT = KvLayout("fake", "float32", 1, 1, 4, 4)
EOS = 999

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def next_token(token_id: int) -> int:
    return (token_id * 7 + 3) % 1000


def expected_output(prompt, max_tokens, stop=()):
    out, last = [], prompt[-1]
    while len(out) < max_tokens:
        last = next_token(last)
        out.append(last)
        if last in stop:
            break
    return out


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, fail_with=None, overloaded=False, defaults=None, max_requests_in_flight=0):
        self.fail_with = fail_with
        self.overloaded = overloaded
        self.max_requests_in_flight = max_requests_in_flight  # reported in the load (0: not reported)
        # A checkpoint's sampling defaults: with them the pod resolves the params and sends them back, as
        # real prefill pods do; without, it answers as a pod older than resolved_sampling.
        self.defaults = defaults
        self.calls, self.released = [], []
        self.released_engine_ids = []
        self.release_arrived = asyncio.Event()
        self.delay_s = 0.0  # the prompt takes this long to compute

    async def Prefill(self, request, context):
        self.calls.append(request)
        await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            await context.abort(self.fail_with, "simulated prefill failure")
        work = prefill_request_from_proto(request)
        resolved = None
        if self.defaults is not None:
            resolved = GenerationDefaults(sampling=self.defaults).fill(work.sampling)
            work = dataclasses.replace(work, sampling=resolved)
        first = next_token(work.prompt_token_ids[-1])
        finish = None
        if work.sampling.max_tokens == 1:
            finish = FinishReason.LENGTH
        elif first in work.sampling.stop_token_ids:
            finish = FinishReason.STOP
        handle = None
        if finish is None:
            n = len(work.prompt_token_ids)
            handle = KvHandle("eng-p", "127.0.0.1:1", range(-(-n // 4)), n, 4, LAYOUT, 2**40)
        result = wire.PrefillResult(first, n_prompt(request), finish, handle, resolved_sampling=resolved)
        return prefill_result_to_proto(result)

    async def ReleaseKv(self, request, context):
        self.released.append(request.request_id)
        self.released_engine_ids.append(request.engine_id)
        self.release_arrived.set()
        return prefill_pb2.ReleaseKvResponse(intact=True)

    async def GetLoad(self, request, context):
        load = common_pb2.LoadReport(is_overloaded=self.overloaded, max_requests_in_flight=self.max_requests_in_flight)
        return common_pb2.GetLoadResponse(load=load, engine_id="eng-p")


def n_prompt(request):
    return len(request.prompt_token_ids)


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, fail_after=None, delay_s=0.0, overloaded=False, num_refusals=0, freeze_after=None,
                 die_at_last=False, pull_outcome=None, deny_handles=False):
        self.fail_after = fail_after  # abort UNAVAILABLE after this many tokens
        self.die_at_last = die_at_last  # send the last token without its finish reason, then abort UNAVAILABLE
        self.delay_s = delay_s
        self.overloaded = overloaded
        self.num_refusals = num_refusals  # answer the first calls RESOURCE_EXHAUSTED with a retry hint
        self.freeze_after = freeze_after  # stop sending (but keep the call open) after this many tokens
        self.calls, self.time_remaining, self.cancelled = [], [], asyncio.Event()
        self.num_refused = 0
        self.pull_outcome = pull_outcome  # what the pull of a handle came to (default: pulled)
        self.deny_handles = deny_handles  # refuse every handle, as a pod with another handle key does
        self.load_delay_s = 0.0  # GetLoad answers this late (a busy or paused pod's probe)
        self.num_waiting = 0  # what its load reports queued
        self.pause = None  # (after this many tokens, seconds): send nothing for a while, then go on
        self.num_running = 0  # what its load reports running
        self.health_delay_s = 0.0  # its health Check answers this late (a pod starved of CPU, or frozen)

    async def Decode(self, request, context):
        work = decode_request_from_proto(request)
        if self.num_refused < self.num_refusals:
            self.num_refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "simulated overload",
                                trailing_metadata=(("retry-after-ms", "30"),))
        self.calls.append(work)
        if self.deny_handles and work.handle is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the handle's signature does not verify")
        self.time_remaining.append(context.time_remaining())
        outcome = (self.pull_outcome or KvPullOutcome.PULLED) if work.handle else KvPullOutcome.NO_HANDLE
        stats = KvPullStats(128, 1, 0, 0.001, outcome)
        last = (work.generated_token_ids or work.prompt_token_ids)[-1]
        num_out = len(work.generated_token_ids)
        sent = 0
        try:
            while True:
                if self.freeze_after is not None and sent == self.freeze_after:
                    await asyncio.sleep(3600)
                if self.pause is not None and sent == self.pause[0]:
                    await asyncio.sleep(self.pause[1])
                if self.fail_after is not None and sent == self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated decode crash")
                await asyncio.sleep(self.delay_s)
                last = next_token(last)
                num_out += 1
                sent += 1
                finish = None
                if last in work.sampling.stop_token_ids:
                    finish = FinishReason.STOP
                elif num_out >= work.sampling.max_tokens:
                    finish = FinishReason.LENGTH
                if finish is not None and self.die_at_last:
                    yield decode_chunk_to_proto(wire.DecodeChunk([last], None, stats if sent == 1 else None))
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated crash after the last token")
                yield decode_chunk_to_proto(wire.DecodeChunk([last], finish, stats if sent == 1 else None))
                if finish is not None:
                    return
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def GetLoad(self, request, context):
        await asyncio.sleep(self.load_delay_s)
        load = common_pb2.LoadReport(is_overloaded=self.overloaded, num_waiting=self.num_waiting,
                                     num_running=self.num_running)
        return common_pb2.GetLoadResponse(load=load, engine_id="eng-d")


async def start_fake(servicer, add, name, serving=True):
    server = GrpcServer(ServerOptions(port=0, grace_seconds=0))
    server.add_service(add, servicer, name)
    if hasattr(servicer, "health_delay_s"):
        check = server._health.Check  # the server's own health service, answering late on demand

        async def late_check(request, context):
            await asyncio.sleep(servicer.health_delay_s)
            return await check(request, context)

        server._health.Check = late_check
    await server.start()
    await server.set_serving(serving)
    return server


class Cluster:
    """Fake pods + the router servicer on a real gRPC server, all on 127.0.0.1."""

    def __init__(self, prefills, decodes, *, policy="round-robin", codec=None, decode_serving=True,
                 request_timeout_s=None, tracer=None, metrics=None,
                 pool_config=PoolConfig(health_interval_s=30, resolve_interval_s=30, probe_timeout_s=2),
                 **router_settings):
        self.prefills, self.decodes, self.request_timeout_s = prefills, decodes, request_timeout_s
        self.metrics = metrics
        self.pool_config = pool_config
        self.tracer = tracer
        self.policy, self.codec, self.decode_serving = policy, codec, decode_serving
        self.router_settings = router_settings

    async def __aenter__(self):
        self.servers = [await start_fake(p, prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                                         "pdserve.v1.PrefillService") for p in self.prefills]
        self.decode_servers = [await start_fake(d, decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                                                "pdserve.v1.DecodeService", self.decode_serving) for d in self.decodes]
        pool_config = self.pool_config
        prefill_specs = [parse_worker_spec(s.address) for s in self.servers]
        decode_specs = [parse_worker_spec(s.address) for s in self.decode_servers]
        self.prefill_pool = WorkerPool("prefill", prefill_specs, prefill_pb2_grpc.PrefillServiceStub,
                                       "pdserve.v1.PrefillService", pool_config, client_class=PrefillClient)
        self.decode_pool = WorkerPool("decode", decode_specs, decode_pb2_grpc.DecodeServiceStub,
                                      "pdserve.v1.DecodeService", pool_config)
        await self.prefill_pool.start()
        await self.decode_pool.start()
        router_config = RouterConfig(tuple(prefill_specs), tuple(decode_specs), policy=self.policy,
                                     request_timeout_s=self.request_timeout_s, pool=pool_config,
                                     **self.router_settings)
        self.servicer = RouterServicer(self.prefill_pool, self.decode_pool, router_config,
                                       codec=self.codec, tracer=self.tracer, metrics=self.metrics)
        self.router = GrpcServer(ServerOptions(port=0, grace_seconds=0))
        self.router.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, self.servicer,
                                "pdserve.v1.GenerateService")
        await self.router.start()
        self.client = AsyncPdserveClient(self.router.address)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.router.stop(0)
        await self.servicer.drain()
        await self.prefill_pool.close()
        await self.decode_pool.close()
        for server in self.servers + self.decode_servers:
            await server.stop(0)

    async def generate(self, prompt, **kwargs):
        return [chunk async for chunk in self.client.generate(prompt, **kwargs)]


def tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


def run(coro):
    return asyncio.run(coro)


def test_token_one_first_then_decode_relay():
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode()
        async with Cluster([prefill], [decode]) as cluster:
            chunks = await cluster.generate([5, 6, 7], max_tokens=6, request_id="r1")
        want = expected_output([5, 6, 7], 6)
        assert chunks[0].token_ids == want[:1] and chunks[0].finish_reason is None
        assert tokens(chunks) == want
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        assert [c.num_output_tokens for c in chunks] == list(range(1, 7))
        assert all(c.num_prompt_tokens == 3 and c.request_id == "r1" for c in chunks)
        (work,) = decode.calls
        assert work.request_id.startswith("r1.") and prefill.calls[0].request_id == work.request_id
        assert work.generated_token_ids == want[:1] and work.handle is not None and work.handle.num_tokens == 3
        assert prefill.released == []  # the decode pod confirmed the pull itself

    run(scenario())


def test_token_one_that_finishes_never_reaches_decode():
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode()
        stop = next_token(7)
        async with Cluster([prefill], [decode]) as cluster:
            one = await cluster.generate([7], max_tokens=1)
            stopped = await cluster.generate([7], max_tokens=5, stop_token_ids=[stop])
        assert [(c.token_ids, c.finish_reason) for c in one] == [([stop], FinishReason.LENGTH)]
        assert [(c.token_ids, c.finish_reason) for c in stopped] == [([stop], FinishReason.STOP)]
        assert decode.calls == []

    run(scenario())


CHECKPOINT_DEFAULTS = {"max_tokens": 4, "temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.0}


def test_decode_continues_with_the_sampling_prefill_resolved():
    async def scenario():
        prefill = FakePrefill(defaults=CHECKPOINT_DEFAULTS)
        dying, healthy = FakeDecode(die_at_last=True), FakeDecode()
        async with Cluster([prefill], [dying, healthy]) as cluster:
            # Round robin: one of the two requests goes to the pod that dies right after the last token.
            runs = [await cluster.generate([5, 6]) for _ in range(2)]  # no max_tokens: the checkpoint's 4
        for chunks in runs:
            assert tokens(chunks) == expected_output([5, 6], 4)
            assert chunks[-1].finish_reason is FinishReason.LENGTH
        resolved = GenerationDefaults(sampling=CHECKPOINT_DEFAULTS).sampling_params()
        assert [w.sampling for w in dying.calls + healthy.calls] == [resolved, resolved]
        # The silent death came after the last token: complete, no re-issue (the router knew max_tokens).
        assert len(dying.calls) == 1 and len(healthy.calls) == 1

    run(scenario())


def test_decode_gets_the_request_params_from_an_older_prefill_pod():
    async def scenario():
        decode = FakeDecode()
        async with Cluster([FakePrefill()], [decode]) as cluster:
            chunks = await cluster.generate([5, 6], temperature=0.0)
        (work,) = decode.calls
        assert "max_tokens" in work.sampling.unset and "temperature" not in work.sampling.unset
        assert tokens(chunks) == expected_output([5, 6], 16)  # the fake decode pod's fallback, unfilled

    run(scenario())


def test_prefill_unavailable_is_retried_on_another_worker():
    async def scenario():
        broken, good = FakePrefill(fail_with=grpc.StatusCode.UNAVAILABLE), FakePrefill()
        async with Cluster([broken, good], [FakeDecode()]) as cluster:
            outputs = [tokens(await cluster.generate([i + 1], max_tokens=3)) for i in range(3)]
        assert outputs == [expected_output([i + 1], 3) for i in range(3)]
        assert len(broken.calls) == 1  # marked unavailable after the first failure
        assert len(good.calls) == 3

    run(scenario())


def test_all_prefill_workers_failing_gives_unavailable():
    async def scenario():
        async with Cluster([FakePrefill(fail_with=grpc.StatusCode.UNAVAILABLE)], [FakeDecode()]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([1], max_tokens=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in info.value.details()

    run(scenario())


def test_prefill_invalid_argument_is_passed_through():
    async def scenario():
        async with Cluster([FakePrefill(fail_with=grpc.StatusCode.INVALID_ARGUMENT)], [FakeDecode()]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([1], max_tokens=3)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "simulated prefill failure" in info.value.details()

    run(scenario())


def test_decode_crash_mid_stream_is_reissued_without_duplicates():
    async def scenario():
        prefill = FakePrefill()
        crashing, healthy = FakeDecode(fail_after=3), FakeDecode()
        async with Cluster([prefill], [crashing, healthy]) as cluster:
            # Round robin sends the first decode to the lower address; make sure the crashing one is hit.
            runs = [await cluster.generate([11, 12], max_tokens=10) for _ in range(2)]
        want = expected_output([11, 12], 10)
        for chunks in runs:
            assert tokens(chunks) == want
            assert chunks[-1].finish_reason is FinishReason.LENGTH
        assert len(crashing.calls) == 1
        reissue = [w for w in healthy.calls if w.handle is None]
        assert len(reissue) == 1
        # Re-issued as recompute: token 1 + the 3 tokens the crashed pod had streamed, no handle.
        assert reissue[0].generated_token_ids == want[:4] and reissue[0].prompt_token_ids == [11, 12]
        # The crashed pod never confirmed (it sent tokens, so it had): no extra release needed.
        assert prefill.released == []

    run(scenario())


def test_decode_crash_before_confirming_the_pull_releases_the_hold_and_recomputes():
    async def scenario():
        prefill = FakePrefill()
        crashing, healthy = FakeDecode(fail_after=0), FakeDecode()
        async with Cluster([prefill], [crashing, healthy]) as cluster:
            runs = [await cluster.generate([8], max_tokens=5) for _ in range(2)]
            await cluster.servicer.drain()
        assert all(tokens(chunks) == expected_output([8], 5) for chunks in runs)
        assert len(crashing.calls) == 1 and crashing.calls[0].handle is not None
        reissue = [w for w in healthy.calls if w.handle is None]
        assert len(reissue) == 1 and reissue[0].generated_token_ids == expected_output([8], 1)
        # The crashed pod never confirmed the pull: the router freed the hold rather than wait for the lease.
        assert prefill.released == [crashing.calls[0].request_id]

    run(scenario())


def test_decode_server_dying_mid_stream_is_reissued():
    async def scenario():
        decodes = [FakeDecode(delay_s=0.05), FakeDecode(delay_s=0.05)]
        async with Cluster([FakePrefill()], decodes) as cluster:
            got = []
            async for chunk in cluster.client.generate([3], max_tokens=20):
                got.extend(chunk.token_ids)
                if len(got) == 4:
                    victim = next(i for i, d in enumerate(decodes) if d.calls)
                    await cluster.decode_servers[victim].stop(0)  # the pod goes away mid-stream
        assert got == expected_output([3], 20)
        survivor = decodes[1 - victim]
        assert len(survivor.calls) == 1 and survivor.calls[0].handle is None
        assert 4 <= len(survivor.calls[0].generated_token_ids) < 20

    run(scenario())


def test_no_healthy_decode_fails_before_prefill():
    async def scenario():
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode()], decode_serving=False) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=4, request_id="lost")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy decode worker" in info.value.details()
        assert prefill.calls == []  # no token 1 for a request no decode pod can take

    run(scenario())


def test_overloaded_decode_tier_fails_before_prefill():
    async def scenario():
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode(overloaded=True)]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=4)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "every decode worker is overloaded" in info.value.details()
        assert prefill.calls == []
        # The client learns when to retry, as the pods tell the router (the HTTP front: Retry-After).
        hint = dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]
        assert hint.isdigit() and int(hint) > 0

    run(scenario())


def test_a_decode_pod_overloaded_since_its_last_poll_is_refused_as_overloaded():
    """The fresh admission probe finds the pod overloaded (its last periodic poll did not): the client gets
    RESOURCE_EXHAUSTED with a retry hint, as for any overload, and the pod stays in rotation."""
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode()
        async with Cluster([prefill], [decode]) as cluster:
            decode.overloaded = True
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=4)
            assert cluster.decode_pool.is_healthy(cluster.decode_servers[0].address)
            await cluster.servicer.drain()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "every decode worker is overloaded" in info.value.details()
        assert float(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
        assert decode.calls == [] and len(prefill.released) == len(prefill.calls)  # no hold left behind

    run(scenario())


def test_a_decode_pod_silent_while_busy_is_overloaded_and_one_silent_while_idle_is_unavailable():
    """A probe that times out on a pod with requests in flight (starved of CPU) refuses the request as
    overloaded, with a retry hint, and keeps the pod in rotation; on an idle pod (frozen) it is UNAVAILABLE
    and the pod leaves rotation, as before. Neither gets token 1."""
    async def scenario():
        pool_config = PoolConfig(health_interval_s=30, resolve_interval_s=30, probe_timeout_s=0.2)
        busy, idle = FakeDecode(), FakeDecode()
        busy.num_running = 8
        for decode, code in ((busy, grpc.StatusCode.RESOURCE_EXHAUSTED), (idle, grpc.StatusCode.UNAVAILABLE)):
            prefill = FakePrefill()
            async with Cluster([prefill], [decode], pool_config=pool_config) as cluster:
                decode.health_delay_s = 1.0
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await cluster.generate([3], max_tokens=4)
                is_healthy = cluster.decode_pool.is_healthy(cluster.decode_servers[0].address)
                await cluster.servicer.drain()
            assert info.value.code() == code, info.value.details()
            assert is_healthy is (decode is busy)
            assert (RETRY_AFTER_KEY in dict(info.value.trailing_metadata())) is (decode is busy)
            assert decode.calls == [] and len(prefill.released) == len(prefill.calls)

    run(scenario())


def test_the_decode_pod_admitted_before_token_one_serves_it_though_it_reported_overload_since():
    """Overload a pod reports is for new requests (it queues continuations, never refuses them for their
    wait): the request it admitted before token 1 goes to it, not into a backoff that ends in an error
    after token 1."""
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode()
        prefill.delay_s = 0.5
        async with Cluster([prefill], [decode], decode_admit_timeout_s=0.5) as cluster:
            call = asyncio.ensure_future(cluster.generate([3], max_tokens=6))
            await asyncio.sleep(0.25)  # admitted; the prompt still computes
            decode.overloaded = True
            await cluster.decode_pool.poll()
            got = tokens(await call)
        assert got == expected_output([3], 6)
        assert len(decode.calls) == 1

    run(scenario())


def test_decode_refusals_after_token_one_back_off_until_a_pod_accepts():
    async def scenario():
        decodes = [FakeDecode(num_refusals=3), FakeDecode(num_refusals=3)]
        async with Cluster([FakePrefill()], decodes) as cluster:
            got = tokens(await cluster.generate([3], max_tokens=6))
        assert got == expected_output([3], 6)
        assert sum(d.num_refused for d in decodes) >= 4  # both pods refused before one accepted
        assert sum(len(d.calls) for d in decodes) == 1

    run(scenario())


def test_decode_refusals_past_the_admit_timeout_end_with_resource_exhausted():
    async def scenario():
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode(num_refusals=10**6)], decode_admit_timeout_s=0.3) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=6)
            await cluster.servicer.drain()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert RETRY_AFTER_KEY in dict(info.value.trailing_metadata())  # the pod's hint, passed on
        assert len(prefill.released) == 1  # the hold went back at once

    run(scenario())


def test_frozen_decode_stream_fails_over_without_duplicating_tokens():
    async def scenario():
        decodes = [FakeDecode(freeze_after=3, delay_s=0.01), FakeDecode(freeze_after=3, delay_s=0.01)]
        async with Cluster([FakePrefill()], decodes, stall_timeout_s=0.5) as cluster:
            got = tokens(await cluster.generate([3], max_tokens=5))
        assert got == expected_output([3], 5)
        assert [len(d.calls) for d in decodes] == [1, 1]
        # The re-issue carries exactly what the client had: token 1 and the 3 the frozen pod sent.
        assert sorted(len(d.calls[0].generated_token_ids) for d in decodes) == [1, 4]

    run(scenario())


def test_cancel_right_after_token_one_releases_the_hold():
    async def scenario():
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode(freeze_after=0)]) as cluster:
            stream = cluster.client.generate([2], max_tokens=100)
            async for _ in stream:
                break  # hang up on token 1, before any decode pod confirmed the pull
            await stream.aclose()
            for _ in range(100):
                if prefill.released:
                    break
                await asyncio.sleep(0.01)
        assert len(prefill.released) == 1

    run(scenario())


def test_a_caller_that_closes_the_stream_at_token_one_counts_as_cancelled():
    """A client gone while token 1 is written leaves the call's generator closed at its yield (the HTTP front
    closes it the same way): that is a cancellation, not an error."""
    async def scenario():
        metrics = RouterMetrics(CollectorRegistry())
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode(freeze_after=0)], metrics=metrics) as cluster:
            chunks = cluster.servicer.generate(GenerateInput([2], SamplingParams(max_tokens=100)))
            first = await anext(chunks)
            await chunks.aclose()
            for _ in range(100):
                if prefill.released:
                    break
                await asyncio.sleep(0.01)
        assert first.token_ids == expected_output([2], 1)
        assert len(prefill.released) == 1
        return {outcome: metrics.requests.labels(outcome=outcome)._value.get() for outcome in ("cancelled", "error")}

    assert run(scenario()) == {"cancelled": 1, "error": 0}


def test_more_completions_than_a_tier_ever_admits_is_invalid_argument():
    async def scenario():
        prefill = FakePrefill(max_requests_in_flight=2)
        async with Cluster([prefill], [FakeDecode()]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=4, n=3, seed=1)
            assert len(tokens(await cluster.generate([3], max_tokens=4, n=2, seed=1))) == 8
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "run at most 2 requests at once" in info.value.details()

    run(scenario())


@pytest.mark.parametrize("outcome, released", [
    (KvPullOutcome.RECOMPUTED_ERROR, 1), (KvPullOutcome.PULLED, 0),
])
def test_a_hold_the_decode_pod_did_not_use_is_released_by_the_router(outcome, released):
    # A decode pod that could not read the blocks may not reach the prefill pod to end the hold either.
    async def scenario():
        prefill = FakePrefill()
        async with Cluster([prefill], [FakeDecode(pull_outcome=outcome)]) as cluster:
            assert tokens(await cluster.generate([3], max_tokens=4)) == expected_output([3], 4)
            await cluster.servicer.drain()
        assert len(prefill.released) == released

    run(scenario())


def test_a_handle_the_decode_pod_does_not_verify_is_recomputed_not_lost():
    # The pods' handle keys differ (a deployment mistake): the client still gets its whole output.
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode(deny_handles=True)
        async with Cluster([prefill], [decode]) as cluster:
            assert tokens(await cluster.generate([3], max_tokens=5)) == expected_output([3], 5)
            await cluster.servicer.drain()
        assert [call.handle is not None for call in decode.calls] == [True, False]
        assert len(prefill.released) == 1

    run(scenario())


def test_all_overloaded_gives_resource_exhausted():
    async def scenario():
        async with Cluster([FakePrefill(overloaded=True)], [FakeDecode()]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([3], max_tokens=4)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in info.value.details()

    run(scenario())


@pytest.mark.parametrize(
    "prompt, sampling, needle",
    [
        ([], {}, "prompt token_ids is empty"),
        ([1], {"top_p": 1.0}, None),
        ("hello", {}, "need a tokenizer"),
    ],
)
def test_invalid_input_gives_invalid_argument(prompt, sampling, needle):
    async def scenario():
        async with Cluster([FakePrefill()], [FakeDecode()]) as cluster:
            if needle is None:
                # Client-side validation rejects bad sampling before any call; send a raw bad message instead.
                stub = generate_pb2_grpc.GenerateServiceStub(grpc.aio.insecure_channel(cluster.router.address))
                bad = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1]),
                                                   sampling=common_pb2.SamplingParams(top_p=2.0))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(bad, timeout=5):
                        pass
                assert "top_p" in info.value.details()
            else:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await cluster.generate(prompt, **sampling)
                assert needle in info.value.details()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario())


def test_deadline_is_propagated_and_enforced():
    async def scenario():
        decode = FakeDecode(delay_s=0.2)
        async with Cluster([FakePrefill()], [decode]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([1], max_tokens=50, timeout=1.0)
            await asyncio.wait_for(decode.cancelled.wait(), 5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The wire encoding of grpc-timeout rounds up a little; without propagation this would be None.
        assert decode.time_remaining[0] is not None and decode.time_remaining[0] <= 1.1

    run(scenario())


def test_calls_without_a_deadline_get_the_router_default():
    async def scenario():
        decode = FakeDecode(delay_s=0.2)
        async with Cluster([FakePrefill()], [decode], request_timeout_s=0.8) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([1], max_tokens=50)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert decode.time_remaining[0] is not None and decode.time_remaining[0] <= 0.9

    run(scenario())


def test_client_cancellation_reaches_decode():
    async def scenario():
        prefill, decode = FakePrefill(), FakeDecode(delay_s=0.05)
        async with Cluster([prefill], [decode]) as cluster:
            received = []
            stream = cluster.client.generate([2], max_tokens=1000)
            async for chunk in stream:
                received.extend(chunk.token_ids)
                if len(received) >= 3:
                    break
            await stream.aclose()
            await asyncio.wait_for(decode.cancelled.wait(), 5)
        assert received == expected_output([2], 3)
        assert prefill.released == []  # the decode pod had confirmed the pull: the hold is its business

    run(scenario())


class SlowPrefill(FakePrefill):
    """Answers nothing for 30 s."""

    def __init__(self):
        super().__init__()
        self.cancelled = asyncio.Event()

    async def Prefill(self, request, context):
        self.calls.append(request)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_cancellation_during_prefill_reaches_the_prefill_pod():
    async def scenario():
        prefill = SlowPrefill()
        async with Cluster([prefill], [FakeDecode()]) as cluster:
            task = asyncio.create_task(cluster.generate([2], max_tokens=5))
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.wait_for(prefill.cancelled.wait(), 5)
            # The pod may have answered just as the call ended: any hold it made goes, by request id.
            await asyncio.wait_for(prefill.release_arrived.wait(), 5)
        assert prefill.released == [prefill.calls[0].request_id]
        assert prefill.released_engine_ids == [""]

    run(scenario())


def test_a_deadline_during_prefill_releases_any_hold_by_request_id():
    """The pod's answer (and its hold's handle) can be on the wire when the deadline ends the call."""
    async def scenario():
        prefill = SlowPrefill()
        async with Cluster([prefill], [FakeDecode()]) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cluster.generate([2], max_tokens=5, timeout=0.3)
            await asyncio.wait_for(prefill.release_arrived.wait(), 5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert prefill.released == [prefill.calls[0].request_id]
        assert prefill.released_engine_ids == [""]

    run(scenario())


def test_text_prompt_and_incremental_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(1000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    async def scenario():
        async with Cluster([FakePrefill()], [FakeDecode()], codec=TextCodec.from_path(str(tmp_path))) as cluster:
            return await cluster.generate("w5 w9", max_tokens=4)

    chunks = run(scenario())
    want = expected_output([5, 9], 4)
    assert tokens(chunks) == want
    assert "".join(c.text for c in chunks).split() == [f"w{t}" for t in want]
    assert chunks[0].num_prompt_tokens == 2


def test_resolve_dns_returns_host_port_strings():
    addresses = run(resolve_dns("localhost", 7000))
    assert "127.0.0.1:7000" in addresses
    assert all(a.endswith(":7000") for a in addresses)


def test_dns_names_resolve_to_every_address_and_refresh():
    async def scenario():
        decodes = [FakeDecode(), FakeDecode()]
        servers = [await start_fake(d, decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                                    "pdserve.v1.DecodeService") for d in decodes]
        answers = {"now": [servers[0].address]}

        async def resolver(host, port):
            assert (host, port) == ("decode.test", 7000)
            return answers["now"]

        pool = WorkerPool("decode", [WorkerSpec("decode.test", 7000, True)], decode_pb2_grpc.DecodeServiceStub,
                          "pdserve.v1.DecodeService", PoolConfig(health_interval_s=30, resolve_interval_s=30),
                          resolver=resolver)
        try:
            await pool.start()
            assert pool.addresses == [servers[0].address] and pool.has_healthy
            answers["now"] = [servers[0].address, servers[1].address]
            await pool.resolve()
            await pool.poll()
            assert sorted(pool.addresses) == sorted(s.address for s in servers)
            assert all(v.is_healthy for v in pool.views())

            async def failing(host, port):
                raise OSError("resolver down")

            pool._resolver = failing
            await pool.resolve()  # a failed lookup keeps the last answer
            assert len(pool.addresses) == 2
            pool._resolver = resolver
            answers["now"] = [servers[1].address]
            await pool.resolve()
            assert pool.addresses == [servers[1].address]
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    run(scenario())


def test_sync_client_and_router_main_process(tmp_path):
    """`python -m router` starts, serves Generate through fake pods, and exits cleanly on SIGTERM."""

    async def start_pods():
        p = await start_fake(FakePrefill(), prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                             "pdserve.v1.PrefillService")
        d = await start_fake(FakeDecode(), decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                             "pdserve.v1.DecodeService")
        return p, d

    log_path = tmp_path / "router.log"

    async def scenario():
        prefill, decode = await start_pods()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", "--port", "0", "--metrics-port", "0",
            "--prefill", prefill.address, "--decode", decode.address,
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=log,
        )
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line.startswith("router listening on "), (line, log_path.read_text())
            address = line.split()[3]
            metrics_url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()[-1]
            async with grpc.aio.insecure_channel(address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # both tiers have a healthy worker
            # The blocking client runs in a thread so the fake pods in this loop keep serving.
            def call():
                with PdserveClient(address) as client:
                    return [t for c in client.generate([4, 2], max_tokens=5, timeout=10) for t in c.token_ids]
            assert await asyncio.to_thread(call) == expected_output([4, 2], 5)
            scrape = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=5).read().decode())
            assert 'pdserve_router_requests_total{outcome="ok"} 1.0' in scrape
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await prefill.stop(0)
            await decode.stop(0)

    with open(log_path, "w") as log:
        run(scenario())


def test_route_decisions_are_traced():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def scenario():
        async with Cluster([FakePrefill()], [FakeDecode()], tracer=provider.get_tracer("test")) as cluster:
            await cluster.generate([1, 2], max_tokens=3)

    run(scenario())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["route prefill"].attributes["pdserve.worker"].startswith("127.0.0.1:")
    assert spans["route decode"].attributes["pdserve.policy"] == "round-robin"


def test_bad_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer file not found"):
        TextCodec.from_path(str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        TextCodec.from_path(str(bad))


def test_a_slow_probe_keeps_a_worker_in_rotation_until_several_come_in_a_row():
    """A pod that answers probes late (busy, or paused a moment) keeps serving; only the configured number
    of timeouts in a row takes it out, and a pod that refuses connections goes at once."""
    async def scenario():
        decode = FakeDecode()
        pool_config = PoolConfig(health_interval_s=30, resolve_interval_s=30, probe_timeout_s=0.2,
                                 slow_probes_to_unhealthy=3)
        async with Cluster([FakePrefill()], [decode], pool_config=pool_config) as cluster:
            pool, address = cluster.decode_pool, cluster.decode_servers[0].address
            decode.load_delay_s = 0.5
            for _ in range(2):
                await pool.poll()
                assert pool.is_healthy(address)
            assert tokens(await cluster.generate([5, 6, 7], max_tokens=3)) == expected_output([5, 6, 7], 3)
            await pool.poll()
            assert not pool.is_healthy(address)
            decode.load_delay_s = 0.0
            await pool.poll()
            assert pool.is_healthy(address)
            await cluster.decode_servers[0].stop(0)
            await pool.poll()
            assert not pool.is_healthy(address)

    run(scenario())


def test_a_busy_decode_pod_is_waited_for_not_taken_for_frozen():
    """A request preempted or queued on a pod with requests waiting goes without tokens for a while: the
    router waits for it (the pod passes its probes) instead of re-issuing it elsewhere."""
    async def scenario():
        busy = FakeDecode(delay_s=0.01)
        busy.num_waiting, busy.pause = 40, (2, 1.5)
        async with Cluster([FakePrefill()], [busy], stall_timeout_s=0.5, decode_admit_timeout_s=1.0) as cluster:
            assert tokens(await cluster.generate([3], max_tokens=6, timeout=30)) == expected_output([3], 6)
        assert len(busy.calls) == 1  # never re-issued

    run(scenario())
