"""The NIXL data plane for the KV handoff: one agent per engine, its registered KV pool, block READs.

This module moves bytes only; who holds which blocks and when they are confirmed is the connector's job.

Composition root, before torch is imported: ``os.environ.update(recommended_environment(uses_cuda=...))``
(huge pages for CPU pools; cuda_ipc READs on a GPU without NVLink, which UCX otherwise routes over TCP).

Prefill pod (the side being read from), once at start-up::

    agent = KvTransferAgent(KvTransferAgent.unique_name("prefill"))
    source = agent.register_kv_caches(kv_tensors)   # every layer's K and V, same shape each
    # GetKvSource answers with source: agent_name, agent_metadata, mem_type, regions,
    # block_bytes, num_blocks (KvSource is plain data; map it to proto in convert.py).

  and in every engine-loop iteration while it holds blocks for a peer::

    for peer_name, messages in agent.get_notifs().items():
        ...  # each message is the notif_msg (request id bytes) of a READ that peer completed

  With the progress thread off, UCX advances only inside calls into the agent, so call this every
  step: a READ that asked for a notification is DONE only after this side's next call.

Decode pod (the side that reads), once per prefill engine (cache by agent name)::

    agent = KvTransferAgent(KvTransferAgent.unique_name("decode"))
    agent.register_kv_caches(kv_tensors)
    if not agent.has_peer(source.agent_name):   # add_peer() is also free when already added
        agent.add_peer(source)   # (re)loads it, also after a failure; KvLayoutMismatchError, KvTransferError

  per request, for the blocks that are not in its own prefix cache::

    transfer = agent.read_blocks(source.agent_name, remote_block_ids, local_block_ids,
                                 notif_msg=request_id.encode())   # or None: no notification
    ...  # each engine step:
    state = agent.poll(transfer)          # TransferState.DONE / PENDING / ERROR, never blocks
    if state is not TransferState.PENDING:
        agent.release(transfer)           # then ReleaseKv to prefill on DONE; recompute/fail on ERROR
    # transfer.num_bytes, num_blocks, num_descriptors, seconds, gb_per_s feed spans and metrics.

  read_blocks raises ValueError for bad block ids, UnknownPeerError for a peer never added (or
  removed), KvTransferError when NIXL refuses the READ (a peer that exited: NIXL_ERR_REMOTE_DISCONNECT).
  A failed READ marks the peer failed (has_peer() turns False) and read_blocks refuses it until
  add_peer() reloads it, which raises KvTransferError while the peer stays unreachable (repeated
  posts to a disconnected peer are a crash path in NIXL's UCX backend; see ai-dynamo/nixl#1868).
  A PENDING READ abandoned at a deadline must be release()d; if that returns False NIXL could not
  cancel it, so the local blocks may still be written: keep them and retry the release later.
  On CPU pools UCX copies with process_vm_readv (cma) inside read_blocks itself: the call returns
  after the bytes moved (about 1 ms per 8 MiB on a 2-core VM), so post one READ per request.

write_blocks(peer_name, local_block_ids, remote_block_ids, notif_msg) is the mirror (a push into
  the peer's blocks, polled and released the same way); only the KV transfer benchmark uses it.

Memory: tensors may be CPU (registered as "DRAM") or CUDA ("VRAM", with the tensor's device index;
nixl_memory_type); KvSource carries both, and a peer whose pool is in the other kind of memory is a
KvLayoutMismatchError. Two processes on one GPU then move VRAM with UCX's cuda_ipc (the reader
opens an IPC handle of the peer's allocation and copies on the device).
Every tensor is [num_blocks, ...] and contiguous, so block b of a tensor is the byte range
[b * block_bytes, (b + 1) * block_bytes) from its base address. The agent keeps the tensors alive
until close(): freeing registered memory first corrupts the heap when NIXL tears down.
"""
from __future__ import annotations

import collections
import enum
import importlib
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from shared.engine.kv_transfer.block_runs import as_block_id_array, coalesce_block_run_arrays
from shared.engine.kv_transfer.handle import KvRegion, KvSource

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_MEM_TYPES = ("DRAM", "VRAM")
# Notifications progress() keeps per peer for get_notifs(); older ones are dropped, so a side that
# only calls progress() (and never reads them) does not grow without bound.
MAX_KEPT_NOTIFS_PER_PEER = 4096


def recommended_environment(*, uses_cuda: bool) -> dict[str, str]:
    """Variables to set before torch is imported and any agent exists (both read them once)."""
    environment = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch puts large CPU tensors on huge pages
    if uses_cuda:
        # UCX disables cuda_ipc READs between processes unless NVLink is detected, then falls back
        # to TCP: on one H200 that was 0.5 GB/s instead of 125 GB/s for 128 MiB.
        environment["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    return environment


class KvTransferError(RuntimeError):
    """NIXL refused or failed an operation (peer gone, memory not registered, backend error)."""


class UnknownPeerError(KvTransferError):
    """The peer was never added, or was removed."""


class KvLayoutMismatchError(ValueError):
    """A peer's KV pool cannot exchange blocks with ours (memory type, tensor count or block size differ)."""


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


@dataclass
class KvTransfer:
    """One posted READ (or WRITE): its accounting, and the NIXL handle until release()."""

    peer_name: str
    notif_msg: bytes  # b"" when no notification was asked for
    num_blocks: int
    num_runs: int
    num_descriptors: int
    num_bytes: int
    started_at: float  # time.monotonic()
    finished_at: float | None = None
    state: TransferState = TransferState.PENDING
    error: str | None = None
    op: str = "READ"  # READ pulls the peer's blocks into ours; WRITE pushes ours into the peer's
    handle: Any = field(default=None, repr=False)

    @property
    def is_released(self) -> bool:
        return self.handle is None

    @property
    def seconds(self) -> float | None:
        """Wall time from read_blocks() to the poll() that saw it finish; None while pending."""
        if self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    @property
    def gb_per_s(self) -> float | None:
        seconds = self.seconds
        if seconds is None or self.state is not TransferState.DONE or seconds <= 0:
            return None
        return self.num_bytes / seconds / 1e9


@dataclass(frozen=True)
class _Pool:
    """Layout of a KV pool, local or a peer's."""

    mem_type: str
    regions: tuple[KvRegion, ...]
    block_bytes: int
    num_blocks: int


def nixl_module_names(torch_cuda_version: str | None) -> tuple[str, ...]:
    """NIXL's import names, the one built for torch's CUDA major version first.

    The wheels are named after the CUDA major version they were built for (nixl-cu12 imports as
    nixl_cu12, nixl-cu13 as nixl_cu13); the API is the same. A CPU torch (version None) takes either.
    """
    if torch_cuda_version and torch_cuda_version.split(".")[0] == "13":
        return "nixl_cu13", "nixl_cu12"
    return "nixl_cu12", "nixl_cu13"


def _nixl_api():
    # Imported lazily so that importing this module stays cheap and torch-free: torch's CUDA version
    # is read only if the caller already imported torch (an engine always has).
    torch_module = sys.modules.get("torch")
    torch_cuda_version = getattr(getattr(torch_module, "version", None), "cuda", None)
    for module_name in nixl_module_names(torch_cuda_version):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        return module.nixl_agent, module.nixl_agent_config
    raise KvTransferError("NIXL is not installed (pip install nixl-cu12 or nixl-cu13)")


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
        nixl_agent, nixl_agent_config = _nixl_api()
        # The progress thread stays off: on a small machine it competes with the engine for CPU;
        # progress is driven from the engine loop instead (poll/progress/get_notifs).
        config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self.name = name
        self._agent = nixl_agent(name, config)
        missing = [backend for backend in backends if backend not in self._agent.backends]
        if missing:
            raise KvTransferError(f"NIXL backend(s) {missing} are not available to agent {name!r}")
        self._pool: _Pool | None = None
        self._source: KvSource | None = None
        self._reg_descs = None
        self._kv_tensors: list = []
        self._peers: dict[str, KvSource] = {}
        # _region_arrays of our pool and of each peer's, for building descriptors.
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
        pool = _describe_pool(kv_tensors)
        descs = [(region.base_address, region.num_bytes, region.device_id, "") for region in pool.regions]
        try:
            self._reg_descs = self._agent.register_memory(descs, pool.mem_type)
        except Exception as exc:  # NIXL raises its own exception types; surface one of ours
            raise KvTransferError(f"registering {len(descs)} KV tensors failed: {exc!r}") from exc
        self._pool = pool
        self._local_region_arrays = _region_arrays(pool.regions)
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
        _check_compatible(pool, source)
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
        self._region_arrays[source.agent_name] = _region_arrays(source.regions)

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
        _check_block_ids("remote", remote_ids, source.num_blocks)
        _check_block_ids("local", local_ids, pool.num_blocks)
        if op == "WRITE" and len(np.unique(remote_ids)) != len(remote_ids):
            # coalescing checks the local ids, a READ's destination; a WRITE's is the remote side.
            raise ValueError(f"remote_block_ids contains duplicates: {remote_ids.tolist()}")
        runs = coalesce_block_run_arrays(remote_ids, local_ids)
        local_descs = _run_descs(self._local_region_arrays, pool.block_bytes, runs.local_starts, runs.num_blocks)
        remote_descs = _run_descs(self._region_arrays[peer_name], source.block_bytes, runs.remote_starts,
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

    def _require_pool(self) -> _Pool:
        if self._pool is None:
            raise KvTransferError(f"agent {self.name!r} has no registered KV pool; call register_kv_caches()")
        return self._pool


def _describe_pool(kv_tensors: Sequence["torch.Tensor"]) -> _Pool:
    if not kv_tensors:
        raise ValueError("kv_tensors is empty")
    first = kv_tensors[0]
    for index, tensor in enumerate(kv_tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"kv_tensors[{index}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                f"kv_tensors[0] is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"kv_tensors[{index}] is not contiguous")
    if first.dim() < 1 or first.shape[0] == 0 or first.numel() == 0:
        raise ValueError(f"kv tensors must be [num_blocks, ...] with num_blocks > 0, got {tuple(first.shape)}")
    mem_type, device_id = nixl_memory_type(first.device)
    num_bytes = first.numel() * first.element_size()
    regions = tuple(KvRegion(tensor.data_ptr(), num_bytes, device_id) for tensor in kv_tensors)
    return _Pool(mem_type, regions, num_bytes // first.shape[0], first.shape[0])


def nixl_memory_type(device: "torch.device") -> tuple[str, int]:
    """How NIXL names memory on this device: ("DRAM", 0) for the CPU, ("VRAM", index) for a GPU.

    VRAM with the device index lets UCX pick cuda_ipc between processes on one machine (the peer
    opens an IPC handle of our allocation) instead of staging through host memory.
    """
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        # "cuda" without an index means the current device; torch tensors always carry one.
        return "VRAM", device.index or 0
    raise ValueError(f"kv tensors on {device} cannot be registered with NIXL (cpu or cuda only)")


def _check_compatible(pool: _Pool, source: KvSource) -> None:
    if source.mem_type not in _MEM_TYPES:
        raise ValueError(f"peer {source.agent_name!r} has unknown memory type {source.mem_type!r}")
    if source.mem_type != pool.mem_type:
        # Both sides of the handoff keep KV on the same kind of device (a split deployment runs
        # prefill and decode pods with the same --device); a mixed pair is a misconfiguration, and
        # its transfers would stage through host memory even if UCX accepted them.
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} keeps its KV pool in {source.mem_type}, this pool is in "
            f"{pool.mem_type}: run prefill and decode pods with the same --device"
        )
    if len(source.regions) != len(pool.regions):
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} has {len(source.regions)} KV tensors, this pool has {len(pool.regions)}"
        )
    if source.block_bytes != pool.block_bytes:
        raise KvLayoutMismatchError(
            f"peer {source.agent_name!r} has {source.block_bytes} bytes per block, this pool has {pool.block_bytes}"
        )
    for region in source.regions:
        if region.num_bytes < source.num_blocks * source.block_bytes:
            raise ValueError(
                f"peer {source.agent_name!r} region {region} is smaller than its {source.num_blocks} blocks"
            )


def _check_block_ids(side: str, block_ids: np.ndarray, num_blocks: int) -> None:
    bad = block_ids[(block_ids < 0) | (block_ids >= num_blocks)]
    if len(bad):
        raise ValueError(f"{side} block ids {bad[:8].tolist()} are outside 0..{num_blocks - 1}")


def _region_arrays(regions: Sequence[KvRegion]) -> tuple[np.ndarray, np.ndarray]:
    """(base addresses, device ids) of a pool's tensors as uint64 arrays, made once per pool."""
    bases = np.array([region.base_address for region in regions], dtype=np.uint64)
    device_ids = np.array([region.device_id for region in regions], dtype=np.uint64)
    return bases, device_ids


def _run_descs(region_arrays: tuple[np.ndarray, np.ndarray], block_bytes: int, starts: np.ndarray,
               num_blocks: np.ndarray) -> np.ndarray:
    """(address, length, device id) rows: for each tensor in order, one row per run."""
    bases, device_ids = region_arrays
    offsets = starts.astype(np.uint64) * np.uint64(block_bytes)
    lengths = num_blocks.astype(np.uint64) * np.uint64(block_bytes)
    descs = np.empty((len(bases) * len(starts), 3), dtype=np.uint64)
    descs[:, 0] = (bases[:, None] + offsets[None, :]).ravel()
    descs[:, 1] = np.tile(lengths, len(bases))
    descs[:, 2] = np.repeat(device_ids, len(starts))
    return descs


def _release_quietly(handle) -> None:
    try:
        handle.release()
    except Exception:
        logger.warning("releasing a failed NIXL transfer handle failed", exc_info=True)
