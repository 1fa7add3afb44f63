"""Requests as the engine sees them: sampling parameters, lifecycle status, finish reasons.

No proto and no torch here: both tiers, the scheduler tests and the services share these types.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Upper bounds that keep one request from monopolising a pod; beyond them a value is a mistake.
MAX_TOP_K = 1 << 20
MAX_PROMPT_LOGPROBS = 20
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (ValueError says what is wrong)."""

    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept any iterable (or None) for stop tokens, store an immutable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request inside one engine. Order matters: everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> "FinishReason | None":
        return _FINISHED_REASONS.get(status)


class FinishReason(enum.Enum):
    """Why a request ended, as reported to clients."""

    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the request could not continue (e.g. a grammar rejected every token)

    def __str__(self) -> str:
        return self.value


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

# The Request class (the scheduler's per-request state) lives below; see the engine-core issue.
