"""The domain types that exist only to cross the wire between services: load reports, the KV source a
prefill pod describes, and the validated Prefill/Decode payloads. Plain data, no proto: the router and
the pods share them without loading the stubs' mapping or the NIXL transport."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.kv_cache.events import KvEvent
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullStats, KvSource
from shared.engine.request import FinishReason, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class LoadReport:
    """A pod's load as the router sees it."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_held_blocks: int = 0
    is_overloaded: bool = False
    max_model_len: int | None = None  # the longest prompt + output the pod takes
    max_requests_in_flight: int | None = None  # how many requests the pod admits at once


@dataclass(frozen=True)
class PrefillKvSource:
    """What GetKvSource answers: the engine incarnation, its KV layout, and the NIXL source to read from."""

    engine_id: str
    layout: KvLayout
    source: KvSource


@dataclass(frozen=True)
class PrefillInput:
    """A validated Prefill call."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill pod answers: token 1, and either a finish reason or a handle."""

    first_token_id: int
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None
    handle: KvHandle | None = None
    first_token_logprobs: TokenLogprobs | None = None
    # The request's sampling as the prefill pod resolved it (nothing unset); None from an older pod.
    resolved_sampling: SamplingParams | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # from the second prompt token on

    @property
    def hands_off(self) -> bool:
        """Token 1 did not end the request: a decode pod continues it, pulling the KV under handle (the
        prefill pod's engine decided, shared/engine/kv_transfer/handoff.py's hands_off)."""
        return self.handle is not None


@dataclass(frozen=True)
class DecodeInput:
    """A validated Decode call: continue from prompt + generated, pulling the prompt's KV if handle is set."""

    request_id: str
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    sampling: SamplingParams
    handle: KvHandle | None = None


@dataclass(frozen=True)
class DecodeChunk:
    """One streamed decode message."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    kv_pull: KvPullStats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # on the first chunk with tokens


@dataclass(frozen=True)
class KvEventUpdate:
    """One message of a pod's prefix-cache event stream (a snapshot start replaces all earlier state)."""

    engine_id: str
    block_size: int
    root_hash: bytes
    is_snapshot: bool = False
    events: list[KvEvent] = field(default_factory=list)
