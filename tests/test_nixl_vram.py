"""KV blocks in device memory between two processes on one GPU: NIXL VRAM registration and UCX cuda_ipc.

A spawned "prefill" process keeps a CUDA KV pool with known data; this process reads from it and
writes into it, and checks the bytes. A 64 MiB READ must beat what a host-staged (TCP) path could
do, so a cuda_ipc GET that UCX quietly routes over TCP (0.5 GB/s, vllm-project/vllm#52607) fails here.
Skipped without CUDA; scripts/gpu_check.sh runs it on the GPU machine (-m gpu).
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from shared.engine.kv_transfer.nixl_loading import recommended_environment
from shared.engine.kv_transfer.pool_layout import KvLayoutMismatchError
from shared.engine.kv_transfer.transfer import TransferState
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_TENSORS = 4
BLOCK_SHAPE = (16, 8, 128)  # block_size, kv_heads, head_dim: 32 KiB per block in bf16
NUM_BLOCKS = 2048  # 64 MiB per tensor
TIMEOUT_S = 30.0
# Far above a TCP or host-staged fallback (about 0.5-10 GB/s), far below cuda_ipc on an H200 (> 100).
MIN_READ_GB_PER_S = 20.0


def _known_pool(device: str) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(11)
    return [torch.randn((NUM_BLOCKS, *BLOCK_SHAPE), generator=generator, device=device).to(torch.bfloat16)
            for _ in range(NUM_TENSORS)]


def _serve_device_pool(conn) -> None:
    """Child: a CUDA pool of known data; answers "checksum" requests after peers wrote into it."""
    tensors = _known_pool("cuda")
    with KvTransferAgent(KvTransferAgent.unique_name("prefill")) as agent:
        conn.send(agent.register_kv_caches(tensors))
        while True:
            for peer_name, messages in agent.get_notifs().items():
                conn.send(("notif", peer_name, messages))
            if conn.poll(0.001):
                request = conn.recv()
                if request == "stop":
                    break
                _, block_ids = request
                torch.cuda.synchronize()
                conn.send(("blocks", [tensor[block_ids].cpu() for tensor in tensors]))


@pytest.fixture(scope="module")
def device_peer():
    saved = dict(os.environ)
    os.environ.update(recommended_environment(uses_cuda=True))  # the child inherits it at spawn
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=_serve_device_pool, args=(child_conn,), daemon=True)
    process.start()
    try:
        assert conn.poll(120), "the device-pool process did not publish its KV source"
        yield conn, conn.recv()
    finally:
        conn.send("stop")
        process.join(30)
        if process.is_alive():
            process.kill()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def device_agent(device_peer):
    _, source = device_peer
    tensors = [torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16, device="cuda")
               for _ in range(NUM_TENSORS)]
    agent = KvTransferAgent(KvTransferAgent.unique_name("decode"))
    local_source = agent.register_kv_caches(tensors)
    agent.add_peer(source)
    yield agent, tensors, local_source
    agent.close()


def _wait_notif(conn, timeout_s: float):
    assert conn.poll(timeout_s), "no notification reached the device-pool process"
    kind, peer_name, messages = conn.recv()
    assert kind == "notif"
    return peer_name, messages


def test_cuda_pool_registers_as_vram_of_its_device(device_peer, device_agent):
    _, source = device_peer
    _, _, local_source = device_agent
    assert source.mem_type == local_source.mem_type == "VRAM"
    index = torch.cuda.current_device()
    assert {region.device_id for region in local_source.regions} == {index}


def test_read_between_processes_copies_exact_bytes_at_device_speed(device_peer, device_agent):
    conn, source = device_peer
    agent, tensors, _ = device_agent
    expected = _known_pool("cuda")
    scattered = agent.read_blocks(source.agent_name, [3, 4, 5, 900], [10, 11, 12, 2], notif_msg=b"r1")
    assert agent.wait(scattered, TIMEOUT_S) is TransferState.DONE
    agent.release(scattered)
    assert _wait_notif(conn, TIMEOUT_S) == (agent.name, [b"r1"])
    for local, original in zip(tensors, expected):
        assert torch.equal(local[[10, 11, 12, 2]], original[[3, 4, 5, 900]])

    all_blocks = list(range(NUM_BLOCKS))
    best = 0.0
    for _ in range(3):  # the first READ also opens the peer's IPC handles
        transfer = agent.read_blocks(source.agent_name, all_blocks, all_blocks)
        assert agent.wait(transfer, TIMEOUT_S) is TransferState.DONE
        best = max(best, transfer.gb_per_s)
        agent.release(transfer)
    torch.cuda.synchronize()
    for local, original in zip(tensors, expected):
        assert torch.equal(local, original)
    assert best >= MIN_READ_GB_PER_S, f"256 MiB READ at {best:.1f} GB/s: not cuda_ipc (UCX fell back?)"


def test_write_into_the_peer_lands_and_notifies(device_peer, device_agent):
    conn, source = device_peer
    agent, tensors, _ = device_agent
    for index, tensor in enumerate(tensors):
        tensor[[7, 8]] = float(index + 1)
    torch.cuda.synchronize()
    transfer = agent.write_blocks(source.agent_name, [7, 8], [100, 101], notif_msg=b"w1")
    deadline = time.monotonic() + TIMEOUT_S
    while agent.poll(transfer) is TransferState.PENDING:
        assert time.monotonic() < deadline
    assert transfer.state is TransferState.DONE
    agent.release(transfer)
    assert _wait_notif(conn, TIMEOUT_S) == (agent.name, [b"w1"])
    conn.send(("blocks", [100, 101]))
    kind, blocks = conn.recv()
    assert kind == "blocks"
    for index, written in enumerate(blocks):
        assert torch.all(written == float(index + 1))


def test_a_cpu_pool_refuses_a_vram_peer(device_peer):
    _, source = device_peer
    with KvTransferAgent(KvTransferAgent.unique_name("decode-cpu")) as agent:
        agent.register_kv_caches([torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16)
                                  for _ in range(NUM_TENSORS)])
        with pytest.raises(KvLayoutMismatchError, match="VRAM, this pool is in DRAM"):
            agent.add_peer(source)
