"""KV block READs over NIXL (UCX, loopback) between this process and a spawned prefill process.

Also the pure run-coalescing rules and the clean failures (unknown/removed/dead peer, bad block ids).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time

import pytest
import torch

from shared.engine.kv_transfer.block_runs import BlockRun, coalesce_block_runs
from shared.engine.kv_transfer.nixl_loading import recommended_environment
from shared.engine.kv_transfer.pool_layout import KvLayoutMismatchError
from shared.engine.kv_transfer.transfer import KvTransferError, TransferState, UnknownPeerError
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

pytestmark = pytest.mark.e2e

NUM_TENSORS = 4  # two layers, K and V each
BLOCK_SHAPE = (4, 2, 8)  # block_size, kv_heads, head_dim
DTYPE = torch.bfloat16
PREFILL_BLOCKS = 16
DECODE_BLOCKS = 24
TIMEOUT_S = 10.0


def _prefill_pool() -> list[torch.Tensor]:
    """Known, distinct data in every block of every tensor; the same in any process."""
    tensors = []
    for index in range(NUM_TENSORS):
        generator = torch.Generator().manual_seed(1000 + index)
        tensors.append(torch.randn((PREFILL_BLOCKS, *BLOCK_SHAPE), generator=generator).to(DTYPE))
    return tensors


def _decode_pool() -> list[torch.Tensor]:
    return [torch.zeros((DECODE_BLOCKS, *BLOCK_SHAPE), dtype=DTYPE) for _ in range(NUM_TENSORS)]


def _serve_prefill_pool(conn) -> None:
    """Child process: register the pool, send its KvSource, keep UCX progressing, forward notifications."""
    tensors = _prefill_pool()
    with KvTransferAgent(KvTransferAgent.unique_name("prefill")) as agent:
        conn.send(agent.register_kv_caches(tensors))
        while True:
            for peer_name, messages in agent.get_notifs().items():
                conn.send(("notif", peer_name, messages))
            if conn.poll(0.001):
                if conn.recv() == "stop":
                    break


class _PrefillProcess:
    def __init__(self):
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve_prefill_pool, args=(child_conn,), daemon=True)
        self.process.start()
        if not self.conn.poll(60):
            self.stop()
            raise RuntimeError("prefill process did not publish its KV source")
        self.source = self.conn.recv()

    def wait_notif(self, timeout_s: float) -> tuple[str, list[bytes]]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("no notification reached the prefill process")
        kind, peer_name, messages = self.conn.recv()
        assert kind == "notif"
        return peer_name, messages

    def stop(self) -> int | None:
        """Stop the process; its exit code (0 when its agent shut down cleanly)."""
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode


@pytest.fixture(scope="module")
def prefill():
    process = _PrefillProcess()
    yield process
    assert process.stop() == 0


@pytest.fixture
def decode(prefill):
    tensors = _decode_pool()
    agent = KvTransferAgent(KvTransferAgent.unique_name("decode"))
    agent.register_kv_caches(tensors)
    agent.add_peer(prefill.source)
    yield agent, tensors
    agent.close()


# ---- coalescing ------------------------------------------------------------------------------
def test_coalesce_merges_pairs_contiguous_on_both_sides():
    assert coalesce_block_runs([3, 4, 5, 9], [10, 11, 12, 2]) == [BlockRun(3, 10, 3), BlockRun(9, 2, 1)]


def test_coalesce_breaks_where_only_one_side_is_contiguous():
    assert coalesce_block_runs([1, 2, 3], [5, 6, 8]) == [BlockRun(1, 5, 2), BlockRun(3, 8, 1)]
    assert coalesce_block_runs([1, 3], [5, 6]) == [BlockRun(1, 5, 1), BlockRun(3, 6, 1)]


def test_coalesce_merges_unordered_pairs():
    assert coalesce_block_runs([7, 5, 6], [2, 0, 1]) == [BlockRun(5, 0, 3)]


def test_coalesce_empty_and_invalid_input():
    assert coalesce_block_runs([], []) == []
    with pytest.raises(ValueError, match="local_block_ids"):
        coalesce_block_runs([1, 2], [3])
    with pytest.raises(ValueError, match="duplicates"):
        coalesce_block_runs([1, 2], [3, 3])


def test_coalesce_rejects_non_integer_ids():
    with pytest.raises(ValueError, match="integers"):
        coalesce_block_runs([1.0, 2.0], [3, 4])


def test_coalesce_runs_cover_exactly_the_pairs_and_neighbours_do_not_extend():
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        local_ids = torch.randperm(64, generator=generator)[:40].tolist()
        remote_ids = torch.randint(0, 32, (40,), generator=generator).tolist()
        runs = coalesce_block_runs(remote_ids, local_ids)
        expanded = {(run.remote_start + k, run.local_start + k) for run in runs for k in range(run.num_blocks)}
        assert expanded == set(zip(remote_ids, local_ids))
        assert sum(run.num_blocks for run in runs) == len(local_ids)
        for first, second in zip(runs, runs[1:]):
            extends = (
                second.remote_start == first.remote_start + first.num_blocks
                and second.local_start == first.local_start + first.num_blocks
            )
            assert not extends


# ---- transfers -------------------------------------------------------------------------------
def test_scattered_read_copies_exact_bytes_and_notifies_prefill(prefill, decode):
    agent, tensors = decode
    remote_ids = [3, 4, 5, 9, 0, 15]
    local_ids = [10, 11, 12, 2, 20, 21]
    transfer = agent.read_blocks(prefill.source.agent_name, remote_ids, local_ids, notif_msg=b"request-7")

    assert agent.wait(transfer, TIMEOUT_S) is TransferState.DONE
    expected = _prefill_pool()
    for local_tensor, source_tensor in zip(tensors, expected):
        for remote_id, local_id in zip(remote_ids, local_ids):
            assert torch.equal(local_tensor[local_id], source_tensor[remote_id])
        untouched = [block for block in range(DECODE_BLOCKS) if block not in local_ids]
        assert not local_tensor[untouched].any()
    block_bytes = local_tensor[0].numel() * local_tensor.element_size()
    assert transfer.num_bytes == len(remote_ids) * block_bytes * NUM_TENSORS
    assert agent.num_bytes_read == transfer.num_bytes
    assert transfer.num_runs == 4  # 3-5 -> 10-12 merge; 0 -> 20, 9 -> 2 and 15 -> 21 stay single
    assert transfer.num_descriptors == 4 * NUM_TENSORS
    assert transfer.gb_per_s is not None and transfer.gb_per_s > 0
    assert agent.release(transfer)
    assert prefill.wait_notif(TIMEOUT_S) == (agent.name, [b"request-7"])


def test_contiguous_read_is_one_descriptor_per_tensor(prefill, decode):
    agent, tensors = decode
    transfer = agent.read_blocks(prefill.source.agent_name, list(range(16)), list(range(8, 24)), notif_msg=b"r2")
    assert agent.wait(transfer, TIMEOUT_S) is TransferState.DONE
    assert transfer.num_descriptors == NUM_TENSORS
    for local_tensor, source_tensor in zip(tensors, _prefill_pool()):
        assert torch.equal(local_tensor[8:24], source_tensor)
    agent.release(transfer)
    prefill.wait_notif(TIMEOUT_S)


def test_read_without_notif_msg_sends_no_notification(prefill, decode):
    agent, tensors = decode
    quiet = agent.read_blocks(prefill.source.agent_name, [7], [7], notif_msg=None)
    assert agent.wait(quiet, TIMEOUT_S) is TransferState.DONE
    assert torch.equal(tensors[0][7], _prefill_pool()[0][7])
    agent.release(quiet)
    loud = agent.read_blocks(prefill.source.agent_name, [8], [8], notif_msg=b"after")
    assert agent.wait(loud, TIMEOUT_S) is TransferState.DONE
    agent.release(loud)
    assert prefill.wait_notif(TIMEOUT_S) == (agent.name, [b"after"])


def test_write_pushes_exact_bytes_into_the_peer_and_notifies_it():
    # The push direction (the KV benchmark's WRITE): ours into the peer's blocks, runs merged.
    source_tensors = _prefill_pool()
    target_tensors = _decode_pool()
    with KvTransferAgent(KvTransferAgent.unique_name("writer")) as writer, \
            KvTransferAgent(KvTransferAgent.unique_name("target")) as target:
        writer.register_kv_caches(source_tensors)
        target_source = target.register_kv_caches(target_tensors)
        writer.add_peer(target_source)
        local_ids, remote_ids = [3, 4, 5, 9], [20, 21, 22, 1]
        transfer = writer.write_blocks(target.name, local_ids, remote_ids, notif_msg=b"pushed")
        assert transfer.op == "WRITE" and transfer.num_runs == 2
        deadline = time.monotonic() + TIMEOUT_S
        notifs: dict[str, list[bytes]] = {}
        while writer.poll(transfer) is TransferState.PENDING or not notifs:
            notifs = notifs or target.get_notifs()
            assert time.monotonic() < deadline, "WRITE or its notification did not complete"
        assert transfer.state is TransferState.DONE and notifs == {writer.name: [b"pushed"]}
        for written, original in zip(target_tensors, source_tensors):
            assert torch.equal(written[remote_ids], original[local_ids])
            assert not written[[b for b in range(DECODE_BLOCKS) if b not in remote_ids]].any()
        assert writer.num_bytes_written == transfer.num_bytes and writer.num_bytes_read == 0
        writer.release(transfer)
        with pytest.raises(ValueError, match="remote_block_ids contains duplicates"):
            writer.write_blocks(target.name, [0, 1], [2, 2])


def test_a_vram_peer_is_refused_by_a_dram_pool(prefill):
    with KvTransferAgent(KvTransferAgent.unique_name("decode")) as agent:
        agent.register_kv_caches(_decode_pool())
        with pytest.raises(KvLayoutMismatchError, match="VRAM, this pool is in DRAM"):
            agent.add_peer(dataclasses.replace(prefill.source, mem_type="VRAM"))
        assert not agent.has_peer(prefill.source.agent_name)


def test_recommended_environment():
    assert recommended_environment(uses_cuda=False) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert recommended_environment(uses_cuda=True)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


def test_unknown_and_removed_peer_raise_without_posting(prefill, decode):
    agent, _ = decode
    with pytest.raises(UnknownPeerError):
        agent.read_blocks("no-such-agent", [0], [0], notif_msg=b"x")
    agent.remove_peer(prefill.source.agent_name)
    assert not agent.has_peer(prefill.source.agent_name)
    with pytest.raises(UnknownPeerError):
        agent.read_blocks(prefill.source.agent_name, [0], [0], notif_msg=b"x")


def test_invalid_block_ids_raise_value_error(prefill, decode):
    agent, _ = decode
    peer = prefill.source.agent_name
    with pytest.raises(ValueError, match="remote block ids"):
        agent.read_blocks(peer, [PREFILL_BLOCKS], [0], notif_msg=b"x")
    with pytest.raises(ValueError, match="local block ids"):
        agent.read_blocks(peer, [0], [DECODE_BLOCKS], notif_msg=b"x")
    with pytest.raises(ValueError, match="remote block ids"):
        agent.read_blocks(peer, [-1], [0], notif_msg=b"x")
    with pytest.raises(ValueError):
        agent.read_blocks(peer, [], [], notif_msg=b"x")
    with pytest.raises(ValueError, match="duplicates"):
        agent.read_blocks(peer, [0, 1], [3, 3], notif_msg=b"x")


def test_incompatible_peer_layout_is_rejected(prefill):
    with KvTransferAgent(KvTransferAgent.unique_name("decode")) as agent:
        agent.register_kv_caches(_decode_pool())
        with pytest.raises(KvLayoutMismatchError, match="bytes per block"):
            agent.add_peer(dataclasses.replace(prefill.source, block_bytes=prefill.source.block_bytes * 2))
        with pytest.raises(KvLayoutMismatchError, match="KV tensors"):
            agent.add_peer(dataclasses.replace(prefill.source, regions=prefill.source.regions[:2]))
        assert not agent.has_peer(prefill.source.agent_name)


def test_register_rejects_bad_tensors():
    with KvTransferAgent(KvTransferAgent.unique_name("decode")) as agent:
        with pytest.raises(ValueError, match="empty"):
            agent.register_kv_caches([])
        with pytest.raises(ValueError, match="not contiguous"):
            agent.register_kv_caches([torch.zeros(4, 8, 2).transpose(0, 1)])
        with pytest.raises(ValueError, match=r"kv_tensors\[1\]"):
            agent.register_kv_caches([torch.zeros(4, 8), torch.zeros(4, 9)])
        with pytest.raises(KvTransferError, match="no registered KV pool"):
            agent.kv_source()
        agent.register_kv_caches([torch.zeros(4, 8)])
        with pytest.raises(ValueError, match="already registered"):
            agent.register_kv_caches([torch.zeros(4, 8)])


def test_read_from_a_dead_peer_fails_cleanly():
    """A peer that exited after a good READ: the next READ raises or ends in ERROR, never hangs."""
    peer = _PrefillProcess()
    try:
        with KvTransferAgent(KvTransferAgent.unique_name("decode")) as agent:
            agent.register_kv_caches(_decode_pool())
            agent.add_peer(peer.source)
            first = agent.read_blocks(peer.source.agent_name, [1], [1], notif_msg=b"ok")
            assert agent.wait(first, TIMEOUT_S) is TransferState.DONE
            agent.release(first)
            assert peer.stop() == 0

            deadline = time.monotonic() + TIMEOUT_S
            try:
                second = agent.read_blocks(peer.source.agent_name, [2], [2], notif_msg=b"late")
            except KvTransferError:
                pass
            else:
                while agent.poll(second) is TransferState.PENDING:
                    assert time.monotonic() < deadline, "READ from a dead peer neither failed nor finished"
                    time.sleep(0.01)
                assert second.state is TransferState.ERROR and second.error
                agent.release(second)
            assert agent.is_peer_failed(peer.source.agent_name)
            assert not agent.has_peer(peer.source.agent_name)
            assert agent.num_failed_transfers == 1
            with pytest.raises(KvTransferError, match="failed a transfer"):
                agent.read_blocks(peer.source.agent_name, [3], [3], notif_msg=b"again")
            # Reloading drops the failed peer and reconnects, which a dead peer refuses.
            with pytest.raises(KvTransferError, match="loading metadata"):
                agent.add_peer(peer.source)
            assert not agent.has_peer(peer.source.agent_name)
            assert not agent.is_peer_failed(peer.source.agent_name)
    finally:
        peer.stop()
