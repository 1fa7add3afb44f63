"""The KV-connector contract (vLLM v1 shape): a scheduler side that decides, a worker side that moves bytes.

Every method the scheduler, the runner and the engine call is declared here with a default that
means "nothing to transfer", so a connector overrides only what its role does.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.engine.request import Request
    from shared.engine.sched.output import SchedulerOutput


class KVRole(str, enum.Enum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def requires_kv_delivery(self) -> bool:
        """Only a producer hands KV to a peer when a request completes."""
        return self in (KVRole.PRODUCER, KVRole.BOTH)


class KVLoadFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"  # drop the remote KV and compute the prompt locally
    FAIL = "fail"  # finish the request with FINISHED_ERROR


@dataclass
class KVConnectorMetadata:
    """Per-step instructions from the scheduler side to the worker side."""

    requests: list[Any] = field(default_factory=list)


class KVConnectorBase:
    """Both sides of a connector. Method names follow vLLM v1 so the spec's mocks apply unchanged."""

    def __init__(self, role: KVRole, load_failure_policy: KVLoadFailurePolicy):
        """load_failure_policy: the pod's setting (PodConfig.kv_load_failure_policy), its one default."""
        self.role = KVRole(role)
        # What the scheduler does with a request whose loaded KV turned out bad.
        self.load_failure_policy = KVLoadFailurePolicy(load_failure_policy)

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond num_computed_tokens available externally, and whether they load asynchronously."""
        return 0, False

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Called once local blocks exist for the external tokens: remember where to load them."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Collect this step's load instructions and reset the per-step state."""
        return KVConnectorMetadata()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Any]:
        """(delay_free, handle) for a request that just finished. delay_free keeps its blocks until
        finished_sending reports it; handle (not None only then, for a producer) is what a peer
        needs to pull the held KV: the scheduler reports it as the request's hand-off."""
        return False, None

    def request_aborted(self, request_id: str) -> None:
        """The request was aborted from outside, possibly after it finished: drop anything kept for
        a peer (a producer's hold), so its blocks are freed on the next step."""

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping without requests: holds to watch, transfers in
        flight, events still to report."""
        return False

    def progress_while_idle(self) -> None:
        """Called on the engine thread every idle wait, when no step runs (nothing to do)."""

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register the paged KV tensors (layer name -> tensor) for transfers."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Issue this step's loads (asynchronous: completion shows up in get_finished)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done (a pull-based producer has none)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks whose load failed since the last call."""
        return set()

    def get_pull_stats(self) -> dict[str, Any]:
        """How each load decided since the last call went (request id -> KvPullStats); the scheduler
        hands each to its request's next output."""
        return {}

    def shutdown(self) -> None:
        """Release transfer resources."""
