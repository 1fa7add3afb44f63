"""One posted NIXL READ or WRITE: its accounting and state until it is released, and the errors a
transfer raises."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class KvTransferError(RuntimeError):
    """NIXL refused or failed an operation (peer gone, memory not registered, backend error)."""


class UnknownPeerError(KvTransferError):
    """The peer was never added, or was removed."""


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
