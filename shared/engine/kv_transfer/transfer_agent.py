"""The NIXL data plane for the KV handoff: one agent per engine, its registered KV pool, block READs.

It moves bytes only; who holds which blocks and when they are confirmed is the connector's job.
How each pod uses it, its errors and its memory rules: docs/kv-transfer-agent.md.
"""
from __future__ import annotations

import collections
import logging
import time
import uuid
from typing import TYPE_CHECKING, Sequence

import numpy as np

from shared.engine.kv_transfer.block_runs import as_block_id_array, coalesce_block_run_arrays
from shared.engine.kv_transfer.handle import KvSource
from shared.engine.kv_transfer.nixl_loading import nixl_api
from shared.engine.kv_transfer.pool_layout import (
    PoolLayout, check_block_ids, check_compatible, describe_pool, region_arrays, run_descs,
)
from shared.engine.kv_transfer.transfer import KvTransfer, KvTransferError, TransferState, UnknownPeerError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Notifications progress() keeps per peer for get_notifs(); older ones are dropped, so a side that
# only calls progress() (and never reads them) does not grow without bound.
MAX_KEPT_NOTIFS_PER_PEER = 4096


class KvTransferAgent:
    """A NIXL agent (UCX backend, no progress thread) owning one registered KV pool.

    Not thread-safe (NIXL runs without locks here): call it from one thread, the engine loop;
    kv_source() alone may be called from any thread.
    """

    @staticmethod
    def unique_name(prefix: str) -> str:
        """A name no other agent will have, even across restarts: prefix + random suffix."""
        return f"{prefix}-{uuid.uuid4().hex[:12]}"

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",)):
        if not name:
            raise ValueError("agent name must be a non-empty string")
        nixl_agent, nixl_agent_config = nixl_api()
        # The progress thread stays off: on a small machine it competes with the engine for CPU;
        # progress is driven from the engine loop instead (poll/progress/get_notifs).
        config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self.name = name
        self._agent = nixl_agent(name, config)
        missing = [backend for backend in backends if backend not in self._agent.backends]
        if missing:
            raise KvTransferError(f"NIXL backend(s) {missing} are not available to agent {name!r}")
        self._pool: PoolLayout | None = None
        self._source: KvSource | None = None
        self._reg_descs = None
        self._kv_tensors: list = []
        self._peers: dict[str, KvSource] = {}
        # region_arrays of our pool and of each peer's, for building descriptors.
        self._local_region_arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._region_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._failed_peers: set[str] = set()
        self._open_transfers: list[KvTransfer] = []
        self._notifs: dict[str, collections.deque[bytes]] = {}
        self.num_bytes_read = 0
        self.num_bytes_written = 0
        self.num_transfers = 0
        self.num_failed_transfers = 0
        self._is_closed = False

    # ---- local pool ----------------------------------------------------------------------
    def register_kv_caches(self, kv_tensors: Sequence["torch.Tensor"]) -> KvSource:
        """Register every KV tensor once (same shape, dtype and device each) and describe the pool."""
        self._check_open()
        if self._pool is not None:
            raise ValueError(f"agent {self.name!r} already registered its KV pool")
        pool = describe_pool(kv_tensors)
        descs = [(region.base_address, region.num_bytes, region.device_id, "") for region in pool.regions]
        try:
            self._reg_descs = self._agent.register_memory(descs, pool.mem_type)
        except Exception as exc:  # NIXL raises its own exception types; surface one of ours
            raise KvTransferError(f"registering {len(descs)} KV tensors failed: {exc!r}") from exc
        self._pool = pool
        self._local_region_arrays = region_arrays(pool.regions)
        # Registered memory must outlive the registration: freeing it first corrupts the heap at teardown.
        self._kv_tensors = list(kv_tensors)
        # Fixed from here on; kept so that kv_source() never calls into NIXL from another thread.
        self._source = KvSource(
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            mem_type=pool.mem_type,
            regions=pool.regions,
            block_bytes=pool.block_bytes,
            num_blocks=pool.num_blocks,
        )
        return self._source

    def kv_source(self) -> KvSource:
        """This agent's metadata and pool layout, as a GetKvSource answer carries them (any thread)."""
        self._require_pool()
        return self._source

    # ---- peers ---------------------------------------------------------------------------
    def has_peer(self, peer_name: str) -> bool:
        """The peer is added and usable; False for a failed peer, which add_peer() reloads."""
        return peer_name in self._peers and peer_name not in self._failed_peers

    def add_peer(self, source: KvSource) -> None:
        """Load a peer's metadata so blocks can be read from it; a repeat with the same metadata is free."""
        self._check_open()
        pool = self._require_pool()
        check_compatible(pool, source)
        cached = self._peers.get(source.agent_name)
        if cached is not None:
            is_same = cached.agent_metadata == source.agent_metadata and cached.regions == source.regions
            if is_same and source.agent_name not in self._failed_peers:
                return
            self.remove_peer(source.agent_name)
        try:
            loaded_name = self._agent.add_remote_agent(source.agent_metadata)
        except Exception as exc:
            raise KvTransferError(f"loading metadata of peer {source.agent_name!r} failed: {exc!r}") from exc
        if isinstance(loaded_name, bytes):
            loaded_name = loaded_name.decode()
        if loaded_name != source.agent_name:
            self._agent.remove_remote_agent(loaded_name)
            raise ValueError(f"metadata belongs to agent {loaded_name!r}, not {source.agent_name!r}")
        self._peers[source.agent_name] = source
        self._region_arrays[source.agent_name] = region_arrays(source.regions)

    def is_peer_failed(self, peer_name: str) -> bool:
        """A transfer from this peer failed: add_peer() a fresh KvSource before reading again."""
        return peer_name in self._failed_peers

    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer (restarted or gone): cancel its open transfers and drop the connection to it."""
        if peer_name not in self._peers:
            return
        for transfer in [t for t in self._open_transfers if t.peer_name == peer_name]:
            self.release(transfer)
        del self._peers[peer_name]
        del self._region_arrays[peer_name]
        self._failed_peers.discard(peer_name)
        try:
            self._agent.remove_remote_agent(peer_name)
        except Exception:
            logger.warning("removing NIXL peer %s failed", peer_name, exc_info=True)

    # ---- reading -------------------------------------------------------------------------
    def read_blocks(
        self,
        peer_name: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif_msg: bytes | None = None,
    ) -> KvTransfer:
        """Post one READ of the peer's blocks into ours, all layers, contiguous runs merged.

        With notif_msg, the peer receives it once the READ completes, and the READ only counts as
        DONE once the notification went out, which waits for the peer's next progress() call.
        Without it (None), DONE means the bytes have landed. Returns once posted (for CPU pools that
        is after the copy itself, see the module docstring); poll() it.
        """
        return self._post_blocks("READ", peer_name, remote_block_ids, local_block_ids, notif_msg)

    def write_blocks(
        self,
        peer_name: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif_msg: bytes | None = None,
    ) -> KvTransfer:
        """Post one WRITE of our blocks into the peer's (a push), all layers, contiguous runs merged.

        The mirror of read_blocks: with notif_msg the peer receives it once the bytes have landed
        there. poll() and release() it the same way. The pull protocol does not use it; the KV
        transfer benchmark compares both directions with it.
        """
        return self._post_blocks("WRITE", peer_name, remote_block_ids, local_block_ids, notif_msg)

    def _post_blocks(self, op: str, peer_name: str, remote_block_ids: Sequence[int],
                     local_block_ids: Sequence[int], notif_msg: bytes | None) -> KvTransfer:
        self._check_open()
        pool = self._require_pool()
        source = self._peers.get(peer_name)
        if source is None:
            raise UnknownPeerError(f"no NIXL peer named {peer_name!r}; add_peer() it first")
        if peer_name in self._failed_peers:
            raise KvTransferError(
                f"peer {peer_name!r} failed a transfer; add_peer() a fresh KvSource before transferring again"
            )
        remote_ids = as_block_id_array("remote_block_ids", remote_block_ids)
        local_ids = as_block_id_array("local_block_ids", local_block_ids)
        if len(remote_ids) == 0:
            raise ValueError(f"{op} needs at least one block id")
        check_block_ids("remote", remote_ids, source.num_blocks)
        check_block_ids("local", local_ids, pool.num_blocks)
        if op == "WRITE" and len(np.unique(remote_ids)) != len(remote_ids):
            # coalescing checks the local ids, a READ's destination; a WRITE's is the remote side.
            raise ValueError(f"remote_block_ids contains duplicates: {remote_ids.tolist()}")
        runs = coalesce_block_run_arrays(remote_ids, local_ids)
        local_descs = run_descs(self._local_region_arrays, pool.block_bytes, runs.local_starts, runs.num_blocks)
        remote_descs = run_descs(self._region_arrays[peer_name], source.block_bytes, runs.remote_starts,
                                  runs.num_blocks)
        transfer = KvTransfer(
            peer_name=peer_name,
            notif_msg=b"" if notif_msg is None else bytes(notif_msg),
            num_blocks=len(local_ids),
            num_runs=len(runs),
            num_descriptors=len(local_descs),
            num_bytes=int(local_descs[:, 1].sum()),
            started_at=time.monotonic(),
            op=op,
        )
        transfer.handle = self._post(transfer, pool.mem_type, local_descs, source.mem_type, remote_descs)
        self._open_transfers.append(transfer)
        self.num_transfers += 1
        return transfer

    def _post(self, transfer: KvTransfer, local_mem: str, local_descs, remote_mem: str, remote_descs):
        handle = None
        try:
            handle = self._agent.initialize_xfer(
                transfer.op,
                self._agent.get_xfer_descs(local_descs, local_mem),
                self._agent.get_xfer_descs(remote_descs, remote_mem),
                transfer.peer_name,
                transfer.notif_msg,
            )
            status = self._agent.transfer(handle)
        except Exception as exc:
            if handle is not None:
                _release_quietly(handle)
            self._mark_failed(transfer.peer_name)
            raise KvTransferError(
                f"posting {transfer.op} of {transfer.num_blocks} blocks with {transfer.peer_name!r} failed: {exc!r}"
            ) from exc
        if status == "ERR":
            _release_quietly(handle)
            self._mark_failed(transfer.peer_name)
            raise KvTransferError(
                f"NIXL rejected the {transfer.op} of {transfer.num_blocks} blocks with {transfer.peer_name!r}"
            )
        if status == "DONE":
            self._finish(transfer, TransferState.DONE)
        return handle

    def poll(self, transfer: KvTransfer) -> TransferState:
        """Advance UCX and report the transfer's state without blocking."""
        if transfer.state is not TransferState.PENDING or transfer.is_released:
            return transfer.state
        try:
            status = self._agent.check_xfer_state(transfer.handle)
        except Exception as exc:
            self._finish(transfer, TransferState.ERROR, f"{exc!r}")
            return transfer.state
        if status == "DONE":
            self._finish(transfer, TransferState.DONE)
        elif status != "PROC":
            self._finish(transfer, TransferState.ERROR, f"NIXL transfer state {status}")
        return transfer.state

    def wait(self, transfer: KvTransfer, timeout_s: float) -> TransferState:
        """Poll until the transfer finishes; for tests and tools, an engine loop uses poll()."""
        deadline = time.monotonic() + timeout_s
        while self.poll(transfer) is TransferState.PENDING:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{transfer.op} with {transfer.peer_name!r} still pending after {timeout_s} s")
        return transfer.state

    def release(self, transfer: KvTransfer) -> bool:
        """Free the NIXL handle; a pending READ is cancelled. False if NIXL could not cancel it yet."""
        if transfer.is_released:
            return True
        try:
            transfer.handle.release()
        except Exception:
            logger.warning("releasing %s with %s failed; still in flight", transfer.op, transfer.peer_name,
                           exc_info=True)
            return False
        if transfer.state is TransferState.PENDING:
            # Abandoned by the caller (deadline), not a failure NIXL reported: the peer stays usable.
            transfer.state = TransferState.ERROR
            transfer.error = "cancelled while pending"
            transfer.finished_at = time.monotonic()
            self.num_failed_transfers += 1
        transfer.handle = None
        self._open_transfers.remove(transfer)
        return True

    def _finish(self, transfer: KvTransfer, state: TransferState, error: str | None = None) -> None:
        transfer.state = state
        transfer.error = error
        transfer.finished_at = time.monotonic()
        if state is TransferState.DONE and transfer.op == "READ":
            self.num_bytes_read += transfer.num_bytes
        elif state is TransferState.DONE:
            self.num_bytes_written += transfer.num_bytes
        else:
            self._mark_failed(transfer.peer_name)

    def _mark_failed(self, peer_name: str) -> None:
        self.num_failed_transfers += 1
        if peer_name in self._peers:
            self._failed_peers.add(peer_name)

    # ---- serving side --------------------------------------------------------------------
    def progress(self) -> None:
        """Let UCX advance (it only does inside calls into the agent); keeps notifications for get_notifs()."""
        if self._agent is None:
            return
        for peer_name, messages in self._agent.get_new_notifs().items():
            kept = self._notifs.setdefault(peer_name, collections.deque(maxlen=MAX_KEPT_NOTIFS_PER_PEER))
            kept.extend(messages)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by peer name: each is a completed READ's notif_msg."""
        self.progress()
        notifs, self._notifs = self._notifs, {}
        return {peer_name: list(messages) for peer_name, messages in notifs.items()}

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel open transfers, drop peers, deregister the pool, destroy the agent. Safe to call twice."""
        if self._is_closed:
            return
        had_failures = self.num_failed_transfers > 0
        for transfer in list(self._open_transfers):
            self.release(transfer)
        for peer_name in list(self._peers):
            self.remove_peer(peer_name)
        # UCX must process a failed peer's endpoint before the worker is destroyed; destroying it
        # right after a disconnect error aborts the process (seen with nixl-cu12 1.5.1).
        self._drain(0.3 if had_failures else 0.01)
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception:
                logger.warning("deregistering the KV pool of %s failed", self.name, exc_info=True)
            self._reg_descs = None
            self._kv_tensors = []
        self._is_closed = True
        self._agent = None  # destroy the NIXL agent now, in a known order, not at interpreter exit

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self.progress()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)

    def __enter__(self) -> "KvTransferAgent":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._is_closed:
            raise KvTransferError(f"agent {self.name!r} is closed")

    def _require_pool(self) -> PoolLayout:
        if self._pool is None:
            raise KvTransferError(f"agent {self.name!r} has no registered KV pool; call register_kv_caches()")
        return self._pool


def _release_quietly(handle) -> None:
    try:
        handle.release()
    except Exception:
        logger.warning("releasing a failed NIXL transfer handle failed", exc_info=True)
