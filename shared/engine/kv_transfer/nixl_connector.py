"""What the two NIXL connectors share: the engine's identity and KV layout, its transfer agent, the
clock leases are measured on, and the hook that wakes the engine loop. A prefill pod runs
NixlProducer (nixl_producer.py), a decode pod NixlConsumer (nixl_consumer.py).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from shared.engine.kv_transfer.connector import KVConnectorBase, KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handle import KvLayout
from shared.engine.kv_transfer.handle_signing import HandleSigner
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent


class NixlConnector(KVConnectorBase):
    """Common base of the producer and the consumer side of the lease-confirmed pull (DESIGN.md section 3).

    Every method runs on the engine thread except the ones documented as "any thread"; the state
    they share with it sits behind self._lock.
    """

    def __init__(
        self,
        role: KVRole,
        *,
        engine_id: str,
        layout: KvLayout,
        agent: KvTransferAgent,
        load_failure_policy: KVLoadFailurePolicy,
        clock: Callable[[], float] = time.time,
        signer: HandleSigner = HandleSigner(None),
    ):
        super().__init__(role, load_failure_policy)
        self.engine_id = engine_id
        self.layout = layout
        self.agent = agent
        self._clock = clock
        # Signs the handles a producer mints; checks the ones a consumer is given.
        self.signer = signer
        self._lock = threading.Lock()
        # Set by the composition root: wakes the engine loop when another thread changed the state.
        self.wake: Callable[[], None] = lambda: None

    # Pod-level reports (engine-thread totals); only a producer holds blocks for peers, only a consumer READs.
    num_lease_expiries = 0
    num_reads = 0
    num_read_bytes = 0

    @property
    def num_held_blocks(self) -> int:
        return 0

    def release_all(self) -> None:
        """End every hold (shutdown); a consumer holds none."""

    def progress_while_idle(self) -> None:
        # UCX advances only inside calls into the agent. A peer's READ that is still wiring up (a first
        # meeting) or runs over TCP needs this side too, also once no hold is left here: a client that
        # hung up after token 1 ends the hold while the decode pod's READ is under way, and that READ
        # would then wait for this pod's next request, with the decode pod's blocks.
        self.agent.progress()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.agent.register_kv_caches(list(kv_caches.values()))

    def shutdown(self) -> None:
        self.release_all()
        self.agent.close()

