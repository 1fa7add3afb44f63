"""Frozen, validated engine configuration: scheduler and KV cache.

Construction validates every field and raises ValueError naming the field; the model's own
architecture config lives in shared/engine/model/model_config.py.
"""
from __future__ import annotations

from dataclasses import dataclass


def _require_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and scheduling features of one engine."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    # A prefill chunk of one request never exceeds this many tokens (0: no limit).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # Schedule a multimodal input whole or not at all (never split across steps).
    disable_chunked_mm_input: bool = False
    # Encoder tokens per step (None: max_num_batched_tokens).
    max_num_encoder_input_tokens: int | None = None
    # Placeholder tokens of the largest multimodal input the model takes (None: text only).
    max_mm_input_tokens: int | None = None
    async_scheduling: bool = False
    # Draft tokens per step; with async scheduling the runner proposes them itself.
    num_speculative_tokens: int = 0
    speculative_method: str | None = None

    def __post_init__(self) -> None:
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int("max_model_len", self.max_model_len, 2)
        _require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        if self.max_num_encoder_input_tokens is not None:
            _require_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 0)
        if self.max_mm_input_tokens is not None:
            _require_int("max_mm_input_tokens", self.max_mm_input_tokens, 1)
        if (
            self.disable_chunked_mm_input
            and self.max_mm_input_tokens is not None
            and self.max_num_batched_tokens < self.max_mm_input_tokens
        ):
            raise ValueError(
                f"disable_chunked_mm_input needs max_num_batched_tokens >= max_mm_input_tokens "
                f"({self.max_mm_input_tokens}), got {self.max_num_batched_tokens}: "
                "a multimodal input could never be scheduled whole"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        if self.num_speculative_tokens and self.speculative_method is None:
            raise ValueError("num_speculative_tokens > 0 needs a speculative_method")

    @property
    def encoder_budget(self) -> int:
        if self.max_num_encoder_input_tokens is None:
            return self.max_num_batched_tokens
        return self.max_num_encoder_input_tokens


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and prefix caching."""

    block_size: int = 16
    num_blocks: int = 1024  # including the reserved null block
    enable_prefix_caching: bool = True
    # Mixed into the root of every block-hash chain: engines only share prefixes with equal seeds.
    prefix_hash_seed: str = ""

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        _require_int("num_blocks", self.num_blocks, 2)
        if not isinstance(self.prefix_hash_seed, str):
            raise ValueError(f"prefix_hash_seed must be a string, got {self.prefix_hash_seed!r}")
