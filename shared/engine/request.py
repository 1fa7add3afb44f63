"""Requests as the engine sees them: sampling parameters, lifecycle status, finish reasons.

No proto and no torch here: both tiers, the scheduler tests and the services share these types.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.kv_transfer.handoff import KvTransferParams

# Upper bounds that keep one request from monopolising a pod; beyond them a value is a mistake.
MAX_TOP_K = 1 << 20
MAX_PROMPT_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_N = 16
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as in OpenAI's API
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_TOKENS = 16  # max_tokens when neither the request nor the model names one
# The fields a model's generation_config.json may give defaults for (vLLM's --generation-config auto);
# max_tokens is its max_new_tokens.
MODEL_DEFAULT_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"})


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (ValueError says what is wrong)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 means off
    seed: int | None = None
    prompt_logprobs: int | None = None
    # Text that ends the request; cut from the output text unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) logits of prompt and output tokens
    min_tokens: int = 0  # EOS and stop tokens are masked until this many output tokens exist
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), by token id
    logprobs: int | None = None  # per output token: its log-probability plus this many most likely
    n: int = 1  # completions per prompt (fanned out by the serving layer)
    structured_output: StructuredOutputSpec | None = None
    # Fields (of MODEL_DEFAULT_FIELDS) the client left unset: the engine replaces them with the model's
    # generation_config.json defaults; where the model has none, the value held here (the API's default) stays.
    unset: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # Accept any iterable (or None) for lists, a mapping for logit_bias; store immutable values.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((token, bias) for token, bias in bias)))
        object.__setattr__(self, "unset", frozenset(self.unset))
        if not self.unset <= MODEL_DEFAULT_FIELDS:
            raise ValueError(f"unset names fields without model defaults: {sorted(self.unset - MODEL_DEFAULT_FIELDS)}")
        self._validate()
        self._validate_options()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")

    def _validate_options(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {text!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @functools.cached_property  # read for every sampled row
    def processes_logits(self) -> bool:
        """True when logits change before sampling (penalties, bias, min_tokens, a grammar): the slow path."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.structured_output)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint every output must satisfy: exactly one of a JSON schema (as JSON text), any JSON
    object, a regular expression or a Lark grammar."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [self.json_schema is not None, self.json_object, self.regex is not None, self.grammar is not None]
        if sum(chosen) != 1:
            raise ValueError("structured output takes exactly one of json_schema, json_object, regex, grammar")


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability under the model, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


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


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one multimodal input sits in the prompt: `length` placeholder tokens from `offset`."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"placeholder needs offset >= 0 and length >= 1, got {self.offset}, {self.length}")


class DuplicateRequestError(ValueError):
    """A request with this id is already in the engine (waiting, running, or holding KV for a peer)."""


class Request:
    """The scheduler's per-request state: tokens, progress, lifecycle and in-flight bookkeeping.

    Token lists are owned by the request: read `output_token_ids`/`all_token_ids`, never mutate them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        mm_positions: list[PlaceholderRange] | None = None,
        mm_hashes: list[str] | None = None,
        kv_transfer_params: KvTransferParams | None = None,
        cache_salt: str | None = None,
        structured_output_request=None,
        num_prior_output_tokens: int = 0,
    ) -> None:
        """num_prior_output_tokens: how many trailing prompt tokens are output a previous engine already
        generated (a continued request); penalties and min_tokens count them as output."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if mm_hashes is not None and len(mm_hashes) != len(mm_positions or ()):
            raise ValueError(f"request {request_id!r}: mm_hashes must match mm_positions one to one")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.mm_positions: list[PlaceholderRange] = list(mm_positions or ())
        # Stable per-input identities for prefix-cache keys; positions stand in when absent.
        self.mm_hashes = list(mm_hashes) if mm_hashes is not None else [
            f"{request_id}#{i}" for i in range(len(self.mm_positions))
        ]
        self.kv_transfer_params = kv_transfer_params
        self.cache_salt = cache_salt
        self.structured_output_request = structured_output_request
        if not 0 <= num_prior_output_tokens < len(self.prompt_token_ids):
            raise ValueError(f"request {request_id!r}: num_prior_output_tokens must be in [0, prompt length)")
        self.num_prior_output_tokens = num_prior_output_tokens

        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._start_progress()
        # Stop set: EOS (unless ignored) plus stop tokens, checked once per sampled token.
        stop_ids = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stop_ids.add(eos_token_id)
        self._stop_ids = frozenset(stop_ids)
        self.max_tokens = sampling_params.max_tokens

    def _start_progress(self) -> None:
        """Lifecycle and progress at their start: waiting, nothing computed, nothing in flight."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        # Chained prefix-cache hashes of the full blocks so far (filled by the KV-cache manager).
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.resumable = True  # False once the request failed and must not be continued
        self.error: str | None = None  # set when its own input (a grammar) made it fail
        # Async bookkeeping: tokens expected from steps in flight, tokens scheduled in steps
        # in flight, sampling steps in flight, and the in-flight share that predates a preemption.
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_in_flight_samples = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        # Tokens known to be computed once an asynchronous KV load lands (WAITING_FOR_REMOTE_KVS).
        self.num_pending_computed_tokens = 0
        # Multimodal inputs whose encoder output exists (scheduled at least once).
        self.encoder_inputs_done: set[int] = set()

    # ---- tokens -------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def append_sampled_token_ids(self, sampled: list[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the first stop (a stop token, max_tokens or the model length),
        set the finished status if one was reached, and return the tokens kept."""
        output, all_ids, stop_ids = self._output_token_ids, self._all_token_ids, self._stop_ids
        if len(sampled) == 1:  # the common decode step, kept cheap
            token = sampled[0]
            output.append(token)
            all_ids.append(token)
            if token in stop_ids:
                self._set_stopped(token)
            elif len(output) >= self.max_tokens or len(all_ids) >= max_model_len:
                self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return sampled
        kept = []
        for token in sampled:
            output.append(token)
            all_ids.append(token)
            kept.append(token)
            if token in stop_ids:
                self._set_stopped(token)
                break
            if len(output) >= self.max_tokens or len(all_ids) >= max_model_len:
                self.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        return kept

    def _set_stopped(self, token: int) -> None:
        self.status = RequestStatus.FINISHED_STOPPED
        # EOS is the natural end: no stop reason. A stop token is reported as the reason.
        if token == self.eos_token_id and not self.sampling_params.ignore_eos:
            self.stop_reason = None
        else:
            self.stop_reason = token

    def set_eos_token_id(self, eos_token_id: int | None) -> None:
        """Adopt the engine's EOS when the request was built without one."""
        self.eos_token_id = eos_token_id
        if eos_token_id is not None and not self.sampling_params.ignore_eos:
            self._stop_ids = self._stop_ids | {eos_token_id}

    def add_eos_token_ids(self, token_ids: tuple[int, ...]) -> None:
        """A model's further EOS ids (a checkpoint may list several): each ends the request like a stop
        token and is reported as the stop reason, as vLLM does; ignore_eos ignores them too."""
        if not self.sampling_params.ignore_eos:
            self._stop_ids = self._stop_ids | frozenset(token_ids)

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def skips_prefix_cache(self) -> bool:
        # Prompt logprobs need logits at every prompt position, so no prompt token may be skipped.
        return self.sampling_params.prompt_logprobs is not None

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
