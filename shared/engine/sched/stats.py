"""Scheduler statistics handed to metrics with each update: queue sizes, KV usage, prefix-cache
hits and speculative-decoding acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.kv_cache.manager import PrefixCacheStats


@dataclass
class SpecDecodingStats:
    """Draft tokens verified in one step and how many were accepted (per draft position too)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1


@dataclass
class SchedulerStats:
    """A snapshot after one update."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_for_remote_kv_reqs: int = 0
    num_held_reqs: int = 0  # finished producer requests whose blocks a peer has not released
    num_held_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0  # since the previous snapshot
    prefix_cache_stats: PrefixCacheStats | None = None
    spec_decoding_stats: SpecDecodingStats | None = None
