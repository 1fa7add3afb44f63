"""Scheduler statistics handed to the engine with each update: queue sizes, KV usage, preemptions,
prefix-cache hits and speculative-decoding acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_cache.manager import PrefixCacheStats


@dataclass
class SpecDecodingStats:
    """Draft tokens verified in one step and how many were accepted."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


@dataclass
class SchedulerStats:
    """A snapshot after one update."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # since the previous snapshot
    prefix_cache_stats: PrefixCacheStats | None = None
    spec_decoding_stats: SpecDecodingStats | None = None
