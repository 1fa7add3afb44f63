"""The OpenAI response objects: choices (completions' text, chat's message or delta), logprobs, usage,
the ids every object of one response carries, and the error object. Plain dicts, no web framework."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shared.engine.request import FinishReason, TokenLogprobs

# vLLM clamps -inf log-probabilities to this, so the JSON stays valid.
MIN_LOGPROB = -9999.0

_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


def finish_reason_to_openai(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH_REASONS[reason]


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


@dataclass
class ResponseIds:
    """The id, creation time and model every object of one response carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseIds":
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def completion_choice(index: int, text: str, finish: FinishReason | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason_to_openai(finish)}


def chat_choice(index: int, content: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """finish_reason: OpenAI's (finish_reason_to_openai, or "tool_calls"); content None beside tool calls;
    reasoning: a reasoning model's thinking, when the server reads it apart."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message.update(reasoning_fields(reasoning))
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """vLLM's field for a message's thinking, and reasoning_content, its older name that many clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def chat_delta(index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# Token ids -> the text of each one alone (what logprobs name tokens by), and their own bytes.
TokenTexts = Callable[[list[int]], list[str]]
TokenBytes = Callable[[list[int]], list[bytes]]


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    entries: Sequence[TokenLogprobs | int], token_texts: TokenTexts, text_offset: int
) -> tuple[dict[str, Any], int]:
    """/v1/completions' logprobs of these tokens, as vLLM writes them: each token's text and logprob, a
    {text: logprob} of the token and the most likely ones, and where each token starts in the
    completion's text (from text_offset). An entry that is a bare token id has no logprob (an echoed
    prompt's first token): null for both. Returns it with the offset after the last token."""
    texts = iter(token_texts([token for entry in entries for token in _token_ids_of(entry)]))
    result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = next(texts)
        logprob, top = None, None
        if isinstance(entry, TokenLogprobs):
            logprob = _clamped(entry.logprob)
            top = {token: logprob}
            for _, value in entry.top:
                top.setdefault(next(texts), _clamped(value))
        result["tokens"].append(token)
        result["token_logprobs"].append(logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result, text_offset


def _token_ids_of(entry: TokenLogprobs | int) -> tuple[int, ...]:
    if isinstance(entry, int):
        return (entry,)
    return (entry.token_id, *(token for token, _ in entry.top))


def chat_logprobs(entries: Sequence[TokenLogprobs], token_texts: TokenTexts,
                  token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """/v1/chat/completions' logprobs of these tokens: each token with its logprob and bytes (its own, from
    token_bytes, where a token holds part of a character; else its text's UTF-8), and the most likely tokens
    at its position (most likely first)."""
    token_ids = [token for entry in entries for token in (entry.token_id, *(t for t, _ in entry.top))]
    texts = token_texts(token_ids)
    raw = iter(token_bytes(token_ids) if token_bytes is not None else [text.encode() for text in texts])
    texts = iter(texts)

    def described(logprob: float) -> dict[str, Any]:
        return {"token": next(texts), "logprob": _clamped(logprob), "bytes": list(next(raw))}

    content = []
    for entry in entries:
        item = described(entry.logprob)
        item["top_logprobs"] = [described(logprob) for _, logprob in entry.top]
        content.append(item)
    return {"content": content}
