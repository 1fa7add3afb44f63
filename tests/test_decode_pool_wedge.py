"""A decode pod whose small KV pool is full of pulls never wedges (issue 26, run 2): its only running request is
preempted while pulls admitted behind it wait for their ReleaseKv confirmations (here: a frozen prefill pod,
so each takes the confirmation's whole timeout); once they land, every request still ends with all its tokens
and the decode pod's blocks all come free. Real processes: router, one prefill pod, one decode pod."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import pytest

from pdserve.client import build_generate_request
from shared.serving.wire.generate import generate_chunk_from_proto
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import decode_pb2_grpc, generate_pb2_grpc
from split_cluster import load_report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BLOCK_SIZE = 16
# 40 usable blocks of 16 tokens: the long request alone grows to 35 of them, so it is preempted as soon
# as two 10-block pulls sit beside it.
DECODE_BLOCKS = 41
CONFIRM_TIMEOUT_S = 5.0  # the decode pod's ReleaseKv timeout: how long the pulls wait on the frozen pod
DEADLINE_S = 60.0  # the wedge held requests until their deadline (600 s in the run that found it)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(length)]


class _Stream:
    """One streamed request through the router: tokens so far, and its final status."""

    def __init__(self, stub, prompt: list[int], max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.task = asyncio.ensure_future(self._run(stub, prompt))

    async def _run(self, stub, prompt: list[int]) -> None:
        call = stub.Generate(build_generate_request(prompt, max_tokens=self.max_tokens, ignore_eos=True),
                             timeout=DEADLINE_S)
        try:
            async for message in call:
                self.tokens.extend(generate_chunk_from_proto(message).token_ids)
            self.code = await call.code()
        except grpc.aio.AioRpcError as exc:
            self.code = exc.code()

    async def until_tokens(self, num_tokens: int) -> None:
        while len(self.tokens) < num_tokens:
            assert not self.task.done(), f"ended early: {self.code} after {len(self.tokens)} tokens"
            await asyncio.sleep(0.01)


async def _until(predicate, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the scenario never reached the state it waits for")


async def _scenario(cluster: LocalCluster) -> list[_Stream]:
    prefill, decode = cluster.by_name("prefill-0"), cluster.by_name("decode-0")
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        long = _Stream(stub, _prompt(150, seed=1), max_tokens=400)  # 10 blocks, growing to 35
        await long.until_tokens(5)
        filler = _Stream(stub, _prompt(350, seed=2), max_tokens=48)  # 22 blocks: the next pulls must wait
        await filler.until_tokens(2)
        pulls = [_Stream(stub, _prompt(150, seed=3 + i), max_tokens=8) for i in range(2)]  # 10 blocks each
        # Both reserved their holds and wait in the decode pod's queue for blocks: now freeze the prefill pod,
        # so the confirmations of their pulls (once the filler frees blocks) take CONFIRM_TIMEOUT_S.
        await _until(lambda: load_report(decode.address, decode_pb2_grpc.DecodeServiceStub).num_waiting >= 2, 30)
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            await asyncio.gather(*(s.task for s in (long, filler, *pulls)))
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
    return [long, filler, *pulls]


def test_a_full_pool_of_pulls_does_not_wedge_the_decode_pod(tmp_path):
    cluster = LocalCluster.start(
        pod_args=["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-threads", "1"],
        prefill_args=["--num-blocks", "512"],
        decode_args=["--num-blocks", str(DECODE_BLOCKS), "--prefill-rpc-timeout", str(CONFIRM_TIMEOUT_S)],
        router_args=["--tokenizer", "tiny"], log_dir=tmp_path,
    )
    try:
        streams = asyncio.run(_scenario(cluster))
        ended = [(s.code, len(s.tokens), s.max_tokens) for s in streams]
        assert all(code == grpc.StatusCode.OK and n == m for code, n, m in ended), ended
        decode = cluster.by_name("decode-0")
        report = load_report(decode.address, decode_pb2_grpc.DecodeServiceStub)
        assert report.num_free_blocks == report.num_total_blocks and report.num_waiting == 0, report
    finally:
        cluster.stop()
