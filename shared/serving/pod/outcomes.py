"""How a call ends: the named errors a pod call raises, the one table mapping each to a gRPC status
code and a metrics outcome label, and those labels (the same for the pods and the router)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import grpc

from shared.engine.request import SamplingParams

# Every label value `requests_total{outcome=...}` may take, pods and router alike; fixed so a bug
# cannot explode the series count, and pre-created so a scrape shows zeros before the first request.
OK = "ok"  # finished normally (stop, length, EOS)
ERROR = "error"  # failed inside the service (INTERNAL, UNAVAILABLE, KV unusable under the fail policy)
CANCELLED = "cancelled"  # the caller went away or cancelled
INVALID = "invalid"  # the input was refused (INVALID_ARGUMENT, ALREADY_EXISTS)
OVERLOADED = "overloaded"  # RESOURCE_EXHAUSTED
DEADLINE_EXCEEDED = "deadline_exceeded"  # a phase or the caller's deadline ran out
OUTCOMES = (OK, ERROR, CANCELLED, INVALID, OVERLOADED, DEADLINE_EXCEEDED)


class CallError(Exception):
    """An error that ends a call with the status STATUS_TABLE gives its class; the message says why."""


class InvalidRequest(CallError, ValueError):
    """The caller's input is unusable; param names the request field to blame, where one is (OpenAI's
    error object carries it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_context_length(num_prompt_tokens: int, sampling: SamplingParams, max_model_len: int) -> None:
    """The length rule of serving, checked once, where a request enters: by the router before it forwards
    it, by the colocated server for its callers. The prompt and the max_tokens the caller named (none named:
    at least one token; the pods fill it later within the room left) fit the model's length, or
    InvalidRequest in OpenAI's words (clients detect a context overflow by them; vLLM refuses, never caps)."""
    max_tokens = None if "max_tokens" in sampling.unset else sampling.max_tokens
    num_completion_tokens = 1 if max_tokens is None else max_tokens
    if num_prompt_tokens + num_completion_tokens <= max_model_len:
        return
    reduce = "the messages" if max_tokens is None else "the messages or completion"
    raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{num_prompt_tokens + num_completion_tokens} tokens ({num_prompt_tokens} in the messages, "
                         f"{num_completion_tokens} in the completion). Please reduce the length of {reduce}.",
                         param="messages")


class DuplicateRequestId(CallError):
    """A request with this id is already in flight on the pod."""


# Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds after which a retry may succeed.
RETRY_AFTER_KEY = "retry-after-ms"


class PodOverloaded(CallError):
    """The pod already has as many requests in flight as it admits; retry_after_ms hints when to retry."""

    def __init__(self, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class PodUnavailable(CallError):
    """The pod cannot take or finish the request: it is loading, shutting down, or its engine stopped."""


class KvUnusable(CallError):
    """The handle's KV cannot be used and the kv-load-failure policy says fail instead of recompute."""


class HandleNotAuthentic(CallError):
    """The KV handle was not minted by a prefill pod of this deployment (its signature does not verify)."""


# The one mapping from an error to (status code, outcome label). KvUnusable is FAILED_PRECONDITION:
# the KV the request names is not known good, and the pod's policy forbids recomputing it, so the
# same call cannot succeed anywhere until the caller prefills afresh. UNAVAILABLE would tell the
# router to retry on another decode pod (which would recompute, against the policy); ABORTED is for
# concurrency conflicts.
STATUS_TABLE: dict[type[CallError], tuple[grpc.StatusCode, str]] = {
    InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, INVALID),
    DuplicateRequestId: (grpc.StatusCode.ALREADY_EXISTS, INVALID),
    PodOverloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED),
    PodUnavailable: (grpc.StatusCode.UNAVAILABLE, ERROR),
    KvUnusable: (grpc.StatusCode.FAILED_PRECONDITION, ERROR),
    HandleNotAuthentic: (grpc.StatusCode.PERMISSION_DENIED, INVALID),
}

# The outcome label of a call that ended with a status code (the router sees codes, not errors).
_OUTCOME_OF_CODE = {
    grpc.StatusCode.OK: OK,
    grpc.StatusCode.CANCELLED: CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OVERLOADED,
    **{code: label for code, label in STATUS_TABLE.values() if label == INVALID},
}


def status_of(error: CallError) -> tuple[grpc.StatusCode, str]:
    """The status code and outcome label of a named error (its nearest class in the table)."""
    for cls in type(error).__mro__:
        if cls in STATUS_TABLE:
            return STATUS_TABLE[cls]
    raise TypeError(f"{type(error).__name__} has no entry in STATUS_TABLE")


def outcome_of_code(code: grpc.StatusCode) -> str:
    return _OUTCOME_OF_CODE.get(code, ERROR)


@contextlib.contextmanager
def invalid_on_value_error() -> Iterator[None]:
    """Input checks (convert.*_from_proto, prompt-length checks) raise ValueError: inside this block
    that means the caller's input is bad. Outside it a ValueError stays an internal error."""
    try:
        yield
    except InvalidRequest:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
