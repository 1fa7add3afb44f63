"""The OpenAI request and response shapes: parses /v1/completions and /v1/chat/completions bodies into
the public Generate input (prompt + the domain SamplingParams, in one mapping table) and builds the
response and stream-chunk objects. No web framework here; errors are InvalidRequest saying what is wrong."""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from shared.engine.request import (
    MAX_LOGPROBS,
    MODEL_DEFAULT_FIELDS,
    FinishReason,
    SamplingParams,
    StructuredOutputSpec,
    TokenLogprobs,
)
from shared.serving.convert import UINT32_MAX
from shared.serving.outcomes import InvalidRequest

# OpenAI's default (the domain default is greedy; an OpenAI client that sends no temperature expects 1),
# where the model's generation_config.json sets no temperature either.
OPENAI_DEFAULT_TEMPERATURE = 1.0
# vLLM's completions default when the request names no max_tokens (chat's is the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A batch of prompts runs as this many completions at most (prompts x n), so one request cannot take a
# pod's whole admission.
MAX_COMPLETIONS_PER_REQUEST = 1024  # a pod's default admission (--max-requests-in-flight)
# vLLM clamps -inf log-probabilities to this, so the JSON stays valid.
MIN_LOGPROB = -9999.0

_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {_shortened(value)}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {_shortened(value)}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {_shortened(value)}")
    return value


def _top_k(name: str, value: Any) -> int:
    value = _integer(name, value)
    return 0 if value == -1 else value  # vLLM's "off" is -1, ours is 0


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise InvalidRequest(f"{name} must be a list of token ids (integers in [0, {UINT32_MAX}]), got "
                             f"{_shortened(value)}")
    return tuple(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT32_MAX


def _shortened(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."



def _stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(text, str) for text in value):
        raise InvalidRequest(f"{name} must be a string or a list of strings, got {_shortened(value)}")
    return tuple(value)


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object of token id -> bias, got {_shortened(value)}")
    bad_keys = [token for token in value if not token.isdigit()]
    if bad_keys:
        raise InvalidRequest(f"{name} keys must be token ids, got {bad_keys[:5]!r}")
    return {int(token): _number(f"{name}[{token}]", bias) for token, bias in value.items()}


def _response_format(name: str, value: Any) -> StructuredOutputSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(json_object=True)
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{name}.json_schema.schema must be a JSON schema object")
        return StructuredOutputSpec(json_schema=json.dumps(schema))
    raise InvalidRequest(f"{name} must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, "
                         f"got {_shortened(value)}")


def _guided(kind: str) -> Callable[[str, Any], StructuredOutputSpec]:
    """vLLM's guided_json / guided_regex / guided_grammar."""
    def parse(name: str, value: Any) -> StructuredOutputSpec:
        if kind == "json_schema":
            return StructuredOutputSpec(json_schema=value if isinstance(value, str) else json.dumps(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{name} must be a non-empty string")
        return StructuredOutputSpec(**{kind: value})
    return parse


def _guided_choice(name: str, value: Any) -> StructuredOutputSpec:
    """vLLM's guided_choice: the output is exactly one of these strings (a Lark grammar of literals)."""
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(f"{name} must be a non-empty list of non-empty strings")
    return StructuredOutputSpec(grammar="start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))


# vLLM's structured_outputs object (which replaced its guided_* fields): each constraint by its key there.
_STRUCTURED_OUTPUTS = {"json": _guided("json_schema"), "regex": _guided("regex"), "grammar": _guided("grammar"),
                       "choice": _guided_choice}


def _structured_outputs(name: str, value: Any) -> StructuredOutputSpec:
    """vLLM's {"structured_outputs": {"json" | "regex" | "choice" | "grammar" | "json_object": ...}}: exactly one
    constraint; an option this server does not honour (whitespace_pattern, structural_tag, ...) is refused."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object, got {_shortened(value)}")
    given = {key: option for key, option in value.items() if option is not None and option is not False}
    unsupported = sorted(set(given) - {*_STRUCTURED_OUTPUTS, "json_object"})
    if unsupported:
        raise InvalidRequest(f"'{name}.{unsupported[0]}' is not supported by this server")
    if len(given) != 1:
        raise InvalidRequest(f"{name} takes exactly one of {', '.join([*_STRUCTURED_OUTPUTS, 'json_object'])}")
    [(kind, option)] = given.items()
    if kind == "json_object":
        boolean(f"{name}.json_object", option)
        return StructuredOutputSpec(json_object=True)
    return _STRUCTURED_OUTPUTS[kind](f"{name}.{kind}", option)


# The one mapping from OpenAI request fields to SamplingParams fields: field -> (param, parse).
# A supported option is one more row here.
SAMPLING_FIELDS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", _integer),
    "max_completion_tokens": ("max_tokens", _integer),  # chat's newer name
    "temperature": ("temperature", _number),
    "top_p": ("top_p", _number),
    "top_k": ("top_k", _top_k),
    "min_p": ("min_p", _number),
    "seed": ("seed", _integer),
    "stop_token_ids": ("stop_token_ids", token_ids),
    "ignore_eos": ("ignore_eos", boolean),
    "stop": ("stop", _stop),
    "include_stop_str_in_output": ("include_stop_str_in_output", boolean),
    "presence_penalty": ("presence_penalty", _number),
    "frequency_penalty": ("frequency_penalty", _number),
    "repetition_penalty": ("repetition_penalty", _number),
    "min_tokens": ("min_tokens", _integer),
    "logit_bias": ("logit_bias", _logit_bias),
    "response_format": ("structured_output", _response_format),
    "guided_json": ("structured_output", _guided("json_schema")),
    "guided_regex": ("structured_output", _guided("regex")),
    "guided_grammar": ("structured_output", _guided("grammar")),
    "guided_choice": ("structured_output", _guided_choice),
    "structured_outputs": ("structured_output", _structured_outputs),
    "n": ("n", _integer),
}

# Known OpenAI/vLLM fields this server does not honour yet, with the value that asks for nothing (a
# request may carry that value; any other is refused with 400 rather than silently ignored).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "best_of": 1, "echo": False, "suffix": None,  # echo: on chat (completions take it)
    "functions": None, "function_call": None,  # the deprecated form of tools
    "reasoning_effort": None, "modalities": ["text"], "audio": None, "prediction": None,
    "web_search_options": None, "verbosity": None,
    # vLLM's own extra fields (its defaults ask for nothing).
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "priority": 0, "return_tokens_as_token_ids": False, "return_token_ids": False, "cache_salt": None,
    "documents": None, "kv_transfer_params": None, "allowed_token_ids": None, "bad_words": None,
    "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None, "chat_template": None,
    "mm_processor_kwargs": None, "logits_processors": None, "vllm_xargs": None, "guided_decoding_backend": None,
    "guided_whitespace_pattern": None, "structural_tag": None, "media_io_kwargs": None, "include_reasoning": True,
}
# Fields that change nothing in the output (accepted and ignored).
INFORMATIONAL_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                        "safety_identifier")
_REQUEST_FIELDS = ("model", "stream", "stream_options", "request_id")


@dataclass(frozen=True)
class EchoOptions:
    """/v1/completions' echo: the prompt comes back before the completion (and, with logprobs, the prompt
    tokens' logprobs before the completion's). max_tokens 0 asks for the prompt alone, as vLLM takes it:
    the engine still samples one token, which is not returned."""

    without_output: bool


def completion_echo(body: dict[str, Any]) -> EchoOptions | None:
    echo = body.get("echo")
    if echo is None or not boolean("echo", echo):
        return None
    return EchoOptions(without_output=body.get("max_tokens") == 0)


def sampling_params_from_openai(
    body: dict[str, Any], *, is_chat: bool = False, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS,
    tool_constraint: StructuredOutputSpec | None = None, echo: EchoOptions | None = None,
) -> SamplingParams:
    """The domain SamplingParams an OpenAI request asks for. Where it is silent: the model's defaults
    (filled by the pod, vLLM's --generation-config auto) for the fields it may set, else OpenAI's.
    default_max_tokens: max_tokens when the request names none; chat takes the model's max_new_tokens
    before it, completions never do (vLLM's completions request holds 16 as if the client sent it).
    tool_constraint: the structured output a forced tool_choice needs; echo: a completion's echo (its
    logprobs cover the prompt too)."""
    kwargs: dict[str, Any] = {"temperature": OPENAI_DEFAULT_TEMPERATURE, "max_tokens": default_max_tokens}
    given = set()
    constraints = []
    for name, (param, parse) in SAMPLING_FIELDS.items():
        if body.get(name) is None:
            continue
        value = parse(name, body[name])
        given.add(param)
        if param != "structured_output":
            kwargs[param] = value
        elif value is not None:  # response_format "text" asks for none
            kwargs[param] = value
            constraints.append(name)
    if len(constraints) > 1:
        raise InvalidRequest(f"one structured-output constraint per request: got {' and '.join(constraints)}")
    if tool_constraint is not None:
        # A forced tool call is this turn's whole output: a response_format is for a text answer, which
        # this turn has none of (OpenAI applies it to the turn that answers; vLLM lets the tools win).
        kwargs["structured_output"] = tool_constraint
    if not is_chat:
        given.add("max_tokens")
    kwargs["unset"] = MODEL_DEFAULT_FIELDS - given
    kwargs["logprobs"] = chat_logprobs_count(body) if is_chat else completion_logprobs_count(body)
    if echo is not None:
        kwargs["prompt_logprobs"] = kwargs["logprobs"]
        if echo.without_output:
            kwargs["max_tokens"] = 1
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def completion_logprobs_count(body: dict[str, Any]) -> int | None:
    """/v1/completions' `logprobs`: how many most likely tokens to report beside each output token."""
    value = body.get("logprobs")
    if value is None:
        return None
    return _logprobs_count("logprobs", value)


def chat_logprobs_count(body: dict[str, Any]) -> int | None:
    """/v1/chat/completions' `logprobs: true` with `top_logprobs: k` (0 when absent), as OpenAI and vLLM
    take them: a positive top_logprobs needs logprobs true."""
    wanted = body.get("logprobs") is not None and boolean("logprobs", body["logprobs"])
    top = body.get("top_logprobs")
    count = 0 if top is None else _logprobs_count("top_logprobs", top)
    if count and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    return count if wanted else None


def _logprobs_count(name: str, value: Any) -> int:
    value = _integer(name, value)
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def check_fields(body: dict[str, Any], endpoint_fields: tuple[str, ...]) -> None:
    """InvalidRequest naming the first field that is unknown or not supported yet."""
    known = (*SAMPLING_FIELDS, *INFORMATIONAL_FIELDS, *_REQUEST_FIELDS, *endpoint_fields)
    for name, value in body.items():
        if name in UNSUPPORTED_FIELDS and name not in endpoint_fields:
            if value is not None and value != UNSUPPORTED_FIELDS[name]:
                raise InvalidRequest(f"'{name}' is not supported by this server yet")
        elif name not in known:
            raise InvalidRequest(f"unknown field '{name}'")


@dataclass(frozen=True)
class StreamOptions:
    is_streaming: bool
    include_usage: bool  # a last chunk with the usage (OpenAI)
    continuous_usage: bool  # usage on every chunk (vLLM's continuous_usage_stats)


def stream_options_from_openai(body: dict[str, Any]) -> StreamOptions:
    is_streaming = body.get("stream") is not None and boolean("stream", body["stream"])
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(is_streaming, False, False)
    if not is_streaming:
        raise InvalidRequest("stream_options is only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidRequest(f"stream_options must be an object, got {options!r}")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise InvalidRequest(f"unknown stream_options field '{sorted(unknown)[0]}'")
    return StreamOptions(
        True,
        boolean("stream_options.include_usage", options.get("include_usage", False)),
        boolean("stream_options.continuous_usage_stats", options.get("continuous_usage_stats", False)),
    )


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts of a completions request as OpenAI and vLLM take them: a text, token ids, or a list of
    either (a batch: each prompt gets its n completions)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("'prompt' is required")
    if isinstance(prompt, str) or not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [_one_prompt("prompt", prompt)]
    num_completions = len(prompt) * (body.get("n") if isinstance(body.get("n"), int) else 1)
    if num_completions > MAX_COMPLETIONS_PER_REQUEST:
        raise InvalidRequest(f"a request asks for at most {MAX_COMPLETIONS_PER_REQUEST} completions (prompts x n), "
                             f"got {num_completions}")
    return [_one_prompt(f"prompt[{index}]", item) for index, item in enumerate(prompt)]


def _one_prompt(name: str, prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(f"{name} text is empty")
        return prompt
    ids = list(token_ids(name, prompt))
    if not ids:
        raise InvalidRequest(f"{name} token ids are empty")
    return ids


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, each an object with a role and a content that is text, a list of parts (the
    codec reads their text) or absent."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a 'role'")
        if not isinstance(message.get("content"), (str, list, type(None))):
            raise InvalidRequest(f"messages[{index}].content must be a string or a list of parts")
    return messages


@dataclass(frozen=True)
class ChatTemplateOptions:
    """vLLM's chat request fields for the template (their defaults are vLLM's)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


def chat_template_options(body: dict[str, Any]) -> ChatTemplateOptions:
    add_generation_prompt = body.get("add_generation_prompt")
    continue_final_message = body.get("continue_final_message")
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise InvalidRequest(f"chat_template_kwargs must be an object, got {_shortened(variables)}")
    return ChatTemplateOptions(
        add_generation_prompt=True if add_generation_prompt is None else boolean("add_generation_prompt",
                                                                                  add_generation_prompt),
        continue_final_message=continue_final_message is not None and boolean("continue_final_message",
                                                                               continue_final_message),
        template_variables=variables,
    )


# ---- responses --------------------------------------------------------------------------------


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


def error_object(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}
