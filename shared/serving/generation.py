"""The public generation call in domain terms: what a caller asks (GenerateInput), what comes back chunk by
chunk (GenerateChunk), and how a call that fails ends (CallEnded, with its status). The router and the
colocated pod serve it as `generate()`; the HTTP front calls that directly, and gRPC Generate adapts it."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

import grpc

from shared.engine.request import FinishReason, SamplingParams, TokenLogprobs
from shared.serving.pod.outcomes import RETRY_AFTER_KEY

# A prompt text longer than this is tokenized on a worker thread (a megabyte takes about half a second
# on one core), so the event loop goes on serving the other requests, health checks included.
LONG_TEXT_CHARS = 16_384
# Ids are names, not payloads (a UUID is 36 characters): a client's request id has at most this many.
MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class GenerateInput:
    """One generation request: a prompt (text or token ids) and how to sample it."""

    prompt: str | list[int]
    sampling: SamplingParams
    request_id: str = ""  # "": the server picks one
    timeout_s: float | None = None  # the caller's deadline (None: the server's own request timeout)


@dataclass
class GenerateChunk:
    """One streamed piece of one completion (index: which of the request's n completions)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0
    stop_string: str = ""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class CallEnded(Exception):
    """The call ended with this status (gRPC's codes name it; the HTTP front maps them to its own)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata or ())

    @property
    def retry_after_header(self) -> dict[str, str]:
        """HTTP's Retry-After (whole seconds, at least 1) from the servicer's retry hint, if it gave one."""
        for key, value in self.trailing_metadata:
            if key == RETRY_AFTER_KEY and value.isdigit():
                # Retry-After takes whole seconds; the openai client reads retry-after-ms first.
                return {"Retry-After": str(max(1, math.ceil(int(value) / 1000))), "retry-after-ms": value}
        return {}


# Registers a cleanup to run when the caller's call ends, however it ends (a transport may end a call
# without closing its generator); None where closing the generator always ends the call.
OnEnd = Callable[[Callable[[], None]], None]


class Generate(Protocol):
    def __call__(self, work: GenerateInput, *, on_end: OnEnd | None = None) -> AsyncIterator[GenerateChunk]: ...


def check_request_id(value: str, limit: int = MAX_REQUEST_ID_LENGTH) -> str:
    """A request id travels on every chunk, span and log line: bounded in length."""
    if len(value) > limit:
        raise ValueError(f"request_id has {len(value)} characters; at most {limit} are allowed")
    return value


async def prompt_token_ids(work: GenerateInput, encode: Callable[[str], list[int]] | None, *,
                           no_tokenizer_hint: str) -> list[int]:
    """The prompt's token ids (text encoded with `encode`, on a worker thread when long); ValueError saying
    what is wrong. no_tokenizer_hint: how to serve text prompts, for when `encode` is None."""
    check_request_id(work.request_id)
    if not isinstance(work.prompt, str):
        if not work.prompt:
            raise ValueError("prompt token_ids is empty")
        return list(work.prompt)
    if not work.prompt:
        raise ValueError("prompt text is empty")
    if encode is None:
        raise ValueError(f"text prompts need a tokenizer: {no_tokenizer_hint}, or send token_ids")
    if len(work.prompt) > LONG_TEXT_CHARS:
        prompt = await asyncio.to_thread(encode, work.prompt)
    else:
        prompt = encode(work.prompt)
    if not prompt:
        raise ValueError("prompt text encodes to no tokens")
    return list(prompt)
