"""The prefill side of the NIXL handoff: a finished prompt's blocks are held under a lease until
the decode pod confirms its pull (release) or the lease runs out.
"""
from __future__ import annotations

import hmac
import logging
import math
from dataclasses import dataclass

from shared.engine.kv_transfer.connector import KVRole
from shared.engine.kv_transfer.handle import KvHandle
from shared.engine.kv_cache.hashing import prompt_digest
from shared.engine.kv_transfer.handoff import HoldForPeer
from shared.engine.kv_transfer.nixl_connector import NixlConnector
from shared.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _Hold:
    request_id: str
    block_ids: list[int]
    deadline_unix_ms: int
    prompt_digest: bytes
    is_reserved: bool = False  # a decode pod was let READ it: its handle allows no other pull


class NixlProducer(NixlConnector):
    """Holds prompts' blocks for decode pods. release() and release_all() may run on any thread."""

    def __init__(self, *, lease_s: float, source_address: str = "", **kwargs):
        """lease_s: the pod's setting (PodConfig.lease_s), its one default."""
        super().__init__(KVRole.PRODUCER, **kwargs)
        self.source_address = source_address
        self.lease_s = lease_s
        self._holds: dict[str, _Hold] = {}
        self._released: set[str] = set()  # holds ended, blocks not yet freed by the scheduler
        self.num_lease_expiries = 0

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KvHandle | None]:
        # The scheduler left HoldForPeer only on a request that hands off (handoff.hands_off decided).
        if not isinstance(request.kv_transfer_params, HoldForPeer):
            return False, None
        num_tokens = request.num_prompt_tokens
        held = list(block_ids[: math.ceil(num_tokens / self.layout.block_size)])
        deadline = int((self._clock() + self.lease_s) * 1000)
        digest = prompt_digest(request.prompt_token_ids[:num_tokens], self.layout.block_size)
        with self._lock:
            self._holds[request.request_id] = _Hold(request.request_id, held, deadline, digest)
        handle = KvHandle(
            engine_id=self.engine_id,
            source_address=self.source_address,
            block_ids=tuple(held),
            num_tokens=num_tokens,
            block_size=self.layout.block_size,
            layout=self.layout,
            lease_deadline_unix_ms=deadline,
            prompt_digest=digest,
        )
        return True, self.signer.sign(handle)

    def reserve(self, request_id: str, engine_id: str, prompt_digest: bytes) -> bool:
        """Let one pull READ the hold's blocks (any thread): True only the first time, while the hold is in
        place (not released, abandoned or expired) and was made for this prompt. A replayed handle (under
        another request id, or after its hold ended) is refused here, before anything reads its blocks."""
        now_ms = int(self._clock() * 1000)
        with self._lock:
            hold = self._holds.get(request_id) if engine_id == self.engine_id else None
            if hold is None or hold.is_reserved or now_ms >= hold.deadline_unix_ms:
                return False
            if not hmac.compare_digest(prompt_digest, hold.prompt_digest):
                return False
            hold.is_reserved = True
            return True

    def release(self, request_id: str, engine_id: str, prompt_digest: bytes = b"") -> bool:
        """End a hold (any thread). True only if the hold was in place until now and was made for the
        prompt whose digest the caller gives: the data pulled for that prompt is good. An empty
        digest abandons the hold (nothing pulled is used)."""
        now_ms = int(self._clock() * 1000)
        with self._lock:
            hold = self._holds.pop(request_id, None) if engine_id == self.engine_id else None
            if hold is None:
                return False
            self._released.add(request_id)
        self.wake()
        if not hmac.compare_digest(prompt_digest, hold.prompt_digest):
            if prompt_digest:
                logger.warning("ReleaseKv for %s named another prompt than its hold's: not intact", request_id)
            return False
        return now_ms < hold.deadline_unix_ms

    def request_aborted(self, request_id: str) -> None:
        with self._lock:
            if self._holds.pop(request_id, None) is None:
                return
            self._released.add(request_id)
        self.wake()

    def release_all(self) -> None:
        """End every hold (shutdown, any thread): the scheduler frees the blocks on its next step."""
        with self._lock:
            self._released |= set(self._holds)
            self._holds.clear()
        self.wake()

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(hold.block_ids) for hold in self._holds.values())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Reading notifications is what keeps UCX progressing for the peers' READs.
        self.agent.progress()
        now_ms = int(self._clock() * 1000)
        with self._lock:
            expired = [rid for rid, hold in self._holds.items() if now_ms >= hold.deadline_unix_ms]
            for request_id in expired:
                del self._holds[request_id]
            self.num_lease_expiries += len(expired)
            finished, self._released = self._released | set(expired), set()
        if expired:
            logger.info("lease expired for %d held request(s): %s", len(expired), expired)
        return finished or None, None

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._holds or self._released)
