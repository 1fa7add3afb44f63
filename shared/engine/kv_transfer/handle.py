"""The KV handle a prefill pod hands to a decode pod, the layout fingerprint, and pull outcomes.

Plain domain data: the connector and both servicers use these; shared/serving/wire maps them to proto.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KvLayout:
    """Fingerprint of a KV cache's shape; blocks may move between two pods only when these are equal."""

    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class KvHandle:
    """Where a prompt's KV blocks are held on a prefill pod, and until when."""

    engine_id: str
    source_address: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    layout: KvLayout
    lease_deadline_unix_ms: int
    # Binds the hold to its prompt (hashing.prompt_digest of the num_tokens prompt tokens).
    prompt_digest: bytes = b""
    # HMAC over every other field (handle_signing.py); empty from pods that run unsigned.
    signature: bytes = b""

    def __post_init__(self) -> None:
        # The one check of a handle's shape: every handle that enters a pod is built here.
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if self.block_size < 1:
            raise ValueError("handle.block_size must be > 0")
        if self.block_size != self.layout.block_size:
            raise ValueError(
                f"handle.block_size {self.block_size} differs from handle.layout.block_size {self.layout.block_size}"
            )
        if self.num_tokens < 1:
            raise ValueError("handle.num_tokens must be > 0")
        num_needed = math.ceil(self.num_tokens / self.block_size)
        if len(self.block_ids) != num_needed:
            raise ValueError(
                f"handle has {len(self.block_ids)} block ids but {self.num_tokens} tokens at block_size "
                f"{self.block_size} need {num_needed}"
            )


class KvHandleNotAuthentic(ValueError):
    """A handle whose signature does not verify under the deployment's key: forged or altered."""


class KvHandleOtherPrompt(ValueError):
    """A handle (authentic or not) that was issued for another prompt than the request's."""


class KvPullOutcome(enum.Enum):
    """How a prompt's KV reached the decode pod."""

    PULLED = "pulled"
    PREFIX_CACHE_HIT = "prefix_cache_hit"
    RECOMPUTED_LEASE_EXPIRED = "recomputed_lease_expired"
    RECOMPUTED_ERROR = "recomputed_error"
    RECOMPUTED_LAYOUT_MISMATCH = "recomputed_layout_mismatch"
    NO_HANDLE = "no_handle"


@dataclass(frozen=True)
class KvPullStats:
    """One request's pull, for the first decode message, spans and metrics. num_bytes: what its READ moved,
    also when the data was then found bad and discarded; num_blocks: the blocks used."""

    num_bytes: int
    num_blocks: int
    num_cached_blocks: int
    seconds: float
    outcome: KvPullOutcome

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class KvRegion:
    """One registered KV tensor: where it lives and how many bytes it spans."""

    base_address: int
    num_bytes: int
    device_id: int


@dataclass(frozen=True)
class KvSource:
    """What a reader needs to pull blocks from an agent: its NIXL metadata and its pool's layout.

    regions are in the registering side's tensor order (layer 0 K, layer 0 V, layer 1 K, ...);
    a reader's tensors must come in the same order. block_bytes is per tensor per block.
    """

    agent_name: str
    agent_metadata: bytes
    mem_type: str
    regions: tuple[KvRegion, ...]
    block_bytes: int
    num_blocks: int

    @property
    def bytes_per_block_all_layers(self) -> int:
        return self.block_bytes * len(self.regions)
