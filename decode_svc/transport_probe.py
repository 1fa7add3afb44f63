"""Checks the KV data path to a prefill engine the first time a decode pod meets it: one small NIXL READ
from the engine's KV pool through an agent of its own, so a blocked or broken transport is reported loudly
instead of showing only as prompts recomputed on decode. Also names the UCX transport a pull takes.

NIXL does not report which UCX transport carried a READ (query_xfer_backend says only "UCX"), so the name
is derived from what decides UCX's choice: the memory types, whether the peer shares this pod's network
namespace (then UCX uses shared memory: CMA for host memory, CUDA IPC for GPU memory), and, between hosts,
whether UCX_TLS allows RDMA and this host has an RDMA device; otherwise TCP.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.engine.kv_transfer.handle import KvSource
from shared.engine.kv_transfer.nixl_loading import nixl_api
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent

logger = logging.getLogger(__name__)

PROBE_BYTES = 4096
PROBE_TIMEOUT_S = 5.0
RDMA_TRANSPORTS = ("rc", "ud", "dc", "ib", "rdma")
RDMA_DEVICES = Path("/sys/class/infiniband")
# Every name derive_transport() gives (the `transport` label of the pull and transport-failure metrics).
TRANSPORT_NAMES = ("tcp", "rdma", "cma", "cuda_ipc")


@dataclass(frozen=True)
class ProbeResult:
    peer_address: str
    transport: str
    port_range: str
    error: str | None = None  # None: the READ delivered

    @property
    def is_ok(self) -> bool:
        return self.error is None


def derive_transport(source: KvSource, peer_address: str, *, local_mem_type: str = "DRAM") -> str:
    """The UCX transport a READ from this source takes (see the module docstring for how it is derived)."""
    if _is_local_address(peer_address.rsplit(":", 1)[0]):
        return "cuda_ipc" if source.mem_type == "VRAM" and local_mem_type == "VRAM" else "cma"
    allowed = os.environ.get("UCX_TLS", "all").lower()
    rdma_allowed = allowed == "all" or any(name in allowed for name in RDMA_TRANSPORTS)
    has_rdma_device = RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())
    return "rdma" if rdma_allowed and has_rdma_device else "tcp"


def _is_local_address(host: str) -> bool:
    """Whether host is an address of this network namespace (loopback included)."""
    host = host.strip("[]")
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))  # binds only to an address this namespace owns
        return True
    except OSError:
        return False


class TransportProbe:
    """One NIXL agent with a small scratch buffer; probes run one at a time (call from a worker thread)."""

    def __init__(self, port_range: str, timeout_s: float = PROBE_TIMEOUT_S):
        nixl_agent, nixl_agent_config = nixl_api()
        self.port_range = port_range
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._agent = nixl_agent(KvTransferAgent.unique_name("probe"),
                                 nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._scratch = np.zeros(PROBE_BYTES, dtype=np.uint8)
        self._reg = self._agent.register_memory([(self._scratch.ctypes.data, PROBE_BYTES, 0, "")], "DRAM")

    def probe(self, source: KvSource, peer_address: str, transport: str) -> ProbeResult:
        """One READ from the source's first block; transport is what derive_transport() said (for the log)."""
        with self._lock:
            error = self._read(source)
        return ProbeResult(peer_address, transport, self.port_range, error)

    @staticmethod
    def report(result: ProbeResult, engine_id: str) -> None:
        """Log a conclusive result: passed, or FAILED with what to check."""
        if result.is_ok:
            logger.info("KV transport check passed: prefill engine %s at %s reads over UCX %s",
                        engine_id, result.peer_address, result.transport)
            return
        logger.error(
            "KV transport check FAILED: a %d-byte NIXL READ from prefill engine %s at %s (UCX transport %s) did "
            "not deliver: %s. This pod recomputes the prompts of that engine instead of pulling them until a "
            "check passes; check that the prefill pod's KV port range (its --kv-port-range) is open to this pod, "
            "and this pod's (%s) to the prefill pod (NetworkPolicy, firewall)",
            PROBE_BYTES, engine_id, result.peer_address, result.transport, result.error, result.port_range)

    def _read(self, source: KvSource) -> str | None:
        region = source.regions[0]
        size = min(PROBE_BYTES, source.block_bytes)
        handle = None
        try:
            self._agent.add_remote_agent(source.agent_metadata)
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs([(self._scratch.ctypes.data, size, 0)], "DRAM"),
                self._agent.get_xfer_descs([(region.base_address, size, region.device_id)], source.mem_type),
                source.agent_name, b"")
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.002)
                state = self._agent.check_xfer_state(handle)
            if state == "PROC":
                return f"no answer within {self.timeout_s:.0f} s"
            return None if state == "DONE" else f"NIXL transfer state {state}"
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is the finding
            return repr(exc)
        finally:
            self._forget(source.agent_name, handle)

    def _forget(self, peer_name: str, handle) -> None:
        try:
            if handle is not None:
                handle.release()
            self._agent.remove_remote_agent(peer_name)
        except Exception:  # noqa: BLE001 - a READ NIXL cannot cancel yet stays with this agent
            logger.debug("probe cleanup for %s incomplete", peer_name, exc_info=True)

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001
            logger.debug("probe agent teardown incomplete", exc_info=True)
        self._agent = None
