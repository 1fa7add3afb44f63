"""The decode pod's ReleaseKv confirmation always answers its pull (decode_svc/kv_sources.py): the consumer
keeps a pull, its request and its blocks until on_result comes, so a call cut short (the pod closing its
channels under it) must still answer "no answer" (None). Real gRPC over loopback to a prefill service that
never answers."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_svc.kv_sources import KvSourceCache
from proto.pdserve.v1 import prefill_pb2_grpc
from shared.engine.kv_transfer.handle import KvHandle, KvLayout
from shared.serving.prefill_client import PrefillClientConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]  # it starts a gRPC server

LAYOUT = KvLayout("tiny@0", "float32", num_layers=4, num_kv_heads=4, head_dim=32, block_size=16)


class _SilentPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """A prefill pod that takes ReleaseKv calls and never answers them (frozen mid-call)."""

    def __init__(self) -> None:
        self.received = asyncio.Event()

    async def ReleaseKv(self, request, context):
        self.received.set()
        await asyncio.Event().wait()


async def _confirm_then_close() -> list[tuple[str, bool | None]]:
    server = grpc.aio.server()
    silent = _SilentPrefill()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers: list[tuple[str, bool | None]] = []
    try:
        # A timeout far past the test's: only the close can end the call.
        sources = KvSourceCache(PrefillClientConfig(prefill_rpc_timeout_s=600.0), loop=asyncio.get_running_loop())
        handle = KvHandle("kv_producer-1", f"127.0.0.1:{port}", (1, 2), 32, 16, LAYOUT, 2**62)
        sources.confirm_release(handle, "r1", b"digest", lambda request_id, intact: answers.append((request_id, intact)))
        await asyncio.wait_for(silent.received.wait(), 10)
        await sources.close()
        await asyncio.sleep(0)  # the cancelled call's task finishes
    finally:
        await server.stop(None)
    return answers


def test_a_confirmation_cut_short_by_close_still_answers_the_pull():
    assert asyncio.run(asyncio.wait_for(_confirm_then_close(), 30)) == [("r1", None)]
