"""Plain data the scheduler hands to the model runner, and the runner hands back.

This is the contract between deciding (scheduler) and executing (runner): no torch, no behaviour.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.engine.request import FinishReason, SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (the runner re-adds it)."""

    req_id: str
    prompt_token_ids: list[int]
    # Every token the runner must hold for this request: the prompt plus any output tokens
    # already generated (non-empty output only for a resumed request).
    prefill_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table (one KV-cache group)
    num_computed_tokens: int  # tokens whose KV is already in those blocks
    # Trailing prompt tokens that are output of an earlier engine (a continued request).
    num_prior_output_tokens: int = 0
    structured_output_request: Any = None  # its grammar masks the logits of every sampled token


@dataclass
class CachedRequestData:
    """Requests the runner already holds, scheduled again this step (columnar, one entry per request)."""

    req_ids: list[str]
    # Token ids the runner has not seen yet (non-empty only when the runner cannot know them,
    # e.g. tokens appended by the scheduler itself); the runner tracks its own sampled tokens.
    new_token_ids: list[Sequence[int]]
    new_block_ids: list[list[int] | None]  # blocks appended to the block table this step
    num_computed_tokens: list[int]

    def __len__(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls(req_ids=[], new_token_ids=[], new_block_ids=[], num_computed_tokens=[])


@dataclass
class SchedulerOutput:
    """One step's decisions."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step (incl. drafts)
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]  # req_id -> draft tokens to verify
    scheduled_encoder_inputs: dict[str, list[int]]  # req_id -> multimodal input indices
    # Per KV-cache group: leading blocks of the first running request that every running request shares.
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str] | None = None  # preempted this step: the runner drops their state
    kv_connector_metadata: Any = None  # the connector's per-step metadata (KVConnectorMetadata)


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports after a step."""

    finished_sending: set[str] | None = None  # producer: holds released, blocks may be freed
    finished_recving: set[str] | None = None  # consumer: remote KV landed, request may run
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose load failed
    pull_stats: dict[str, Any] = field(default_factory=dict)  # consumer: req_id -> KvPullStats of a decided load

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids or self.pull_stats)


@dataclass
class ModelRunnerOutput:
    """One step's results, indexed like req_ids."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: sampled tokens (empty for a partial prefill; more than one after accepted drafts).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Any] = field(default_factory=dict)  # req_id -> list[TokenLogprobs] of its sampled tokens
    prompt_logprobs_dict: dict[str, Any] = field(default_factory=dict)
    pooler_output: list[Any] = field(default_factory=list)
    # Draft tokens proposed for the next step, per request (None when speculation is off).
    spec_token_ids: list[list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request produced in one step, for the engine to stream."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set when the finished request was handed off: its KV is held for a peer, which pulls it with this handle.
    kv_handle: Any = None
    new_prompt_logprobs: Any = None
    new_logprobs: Any = None  # list[TokenLogprobs], one per new token, when the request asked for logprobs
    error: str | None = None  # why a request finished with FinishReason.ERROR because of its own input
    kv_pull: Any = None  # KvPullStats: how its prompt's KV was loaded, on the request's first output after

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """One update_from_output() result."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Any = None  # SchedulerStats when the scheduler logs stats
    finished_requests: set[str] = field(default_factory=set)  # finished during this update
