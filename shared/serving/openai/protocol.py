"""The OpenAI request tables: parses /v1/completions and /v1/chat/completions bodies into the generation
input (prompt + the domain SamplingParams, in one mapping table), fields refused by name. No web framework
here; errors are InvalidRequest saying what is wrong."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from shared.engine.request import MAX_LOGPROBS, MODEL_DEFAULT_FIELDS, SamplingParams, StructuredOutputSpec
from shared.serving.wire.common import UINT32_MAX
from shared.serving.generation import GenerateInput
from shared.serving.pod.outcomes import InvalidRequest

# OpenAI's default (the domain default is greedy; an OpenAI client that sends no temperature expects 1),
# where the model's generation_config.json sets no temperature either.
OPENAI_DEFAULT_TEMPERATURE = 1.0
# vLLM's completions default when the request names no max_tokens (chat's is the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A batch of prompts runs as this many completions at most (prompts x n), so one request cannot take a
# pod's whole admission.
MAX_COMPLETIONS_PER_REQUEST = 1024  # a pod's default admission (--max-requests-in-flight)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {shortened(value)}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {shortened(value)}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {shortened(value)}", name)
    return value


def _top_k(name: str, value: Any) -> int:
    value = _integer(name, value)
    return 0 if value == -1 else value  # vLLM's "off" is -1, ours is 0


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise InvalidRequest(f"{name} must be a list of token ids (integers in [0, {UINT32_MAX}]), got "
                             f"{shortened(value)}")
    return tuple(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT32_MAX


def shortened(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."



def _stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(text, str) for text in value):
        raise InvalidRequest(f"{name} must be a string or a list of strings, got {shortened(value)}")
    return tuple(value)


def _token_count(name: str, value: Any) -> int:
    value = _integer(name, value)
    if value > UINT32_MAX:  # the most any service takes (a smaller one is refused by SamplingParams)
        raise InvalidRequest(f"{name} must be an integer in [0, {UINT32_MAX}], got {value!r}")
    return value


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object of token id -> bias, got {shortened(value)}")
    bad_keys = [token for token in value if not token.isdigit()]
    if bad_keys:
        raise InvalidRequest(f"{name} keys must be token ids, got {bad_keys[:5]!r}")
    too_large = [token for token in value if int(token) > UINT32_MAX]
    if too_large:
        raise InvalidRequest(f"logit_bias key must be an integer in [0, {UINT32_MAX}], got {int(too_large[0])!r}")
    return {int(token): _number(f"{name}[{token}]", bias) for token, bias in value.items()}


def _response_format(name: str, value: Any) -> StructuredOutputSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(json_object=True)
    if kind == "json_schema":
        json_schema = value.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{name}.json_schema.schema must be a JSON schema object")
        return StructuredOutputSpec(json_schema=json.dumps(schema))
    raise InvalidRequest(f"{name} must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, "
                         f"got {shortened(value)}")


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
        raise InvalidRequest(f"{name} must be an object, got {shortened(value)}")
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
    "max_tokens": ("max_tokens", _token_count),
    "max_completion_tokens": ("max_tokens", _token_count),  # chat's newer name
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
    "modalities": ["text"], "audio": None, "prediction": None,
    "web_search_options": None,
    "verbosity": "medium",  # OpenAI's default; a model without the setting takes only it, as OpenAI's do
    # vLLM's own extra fields (its defaults ask for nothing).
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "priority": 0, "return_tokens_as_token_ids": False, "return_token_ids": False, "cache_salt": None,
    "documents": None, "kv_transfer_params": None, "allowed_token_ids": None, "bad_words": None,
    "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None, "chat_template": None,
    "mm_processor_kwargs": None, "logits_processors": None, "vllm_xargs": None, "guided_decoding_backend": None,
    "guided_whitespace_pattern": None, "structural_tag": None, "media_io_kwargs": None, "include_reasoning": True,
}
def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {shortened(value)}", name)
    return value


def _metadata(name: str, value: Any) -> dict[str, str]:
    """OpenAI's metadata: string keys to string values."""
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise InvalidRequest(f"{name} must be an object of strings, got {shortened(value)}", name)
    return value


# Fields that change nothing in the output (accepted when of their type, and ignored): field -> its check.
INFORMATIONAL_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "user": _string, "metadata": _metadata, "store": boolean, "service_tier": _string,
    "parallel_tool_calls": boolean, "prompt_cache_key": _string, "prompt_cache_retention": _string,
    "safety_identifier": _string,
}
_REQUEST_FIELDS = ("model", "stream", "stream_options", "request_id")


@dataclass(frozen=True)
class EchoOptions:
    """/v1/completions' echo: the prompt comes back before the completion (and, with logprobs, the prompt
    tokens' logprobs before the completion's). max_tokens 0 asks for the prompt alone, as vLLM takes it:
    the engine still samples one token, which is not returned."""

    without_output: bool


def _parsed_field(parse: Callable[[str, Any], Any], name: str, value: Any) -> Any:
    """parse(name, value), its refusal naming the field."""
    try:
        return parse(name, value)
    except InvalidRequest as exc:
        exc.param = exc.param or name
        raise


def completion_echo(body: dict[str, Any]) -> EchoOptions | None:
    echo = body.get("echo")
    if echo is None or not boolean("echo", echo):
        return None
    return EchoOptions(without_output=body.get("max_tokens") == 0)


def sampling_params_from_openai(
    body: dict[str, Any], *, is_chat: bool = False, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS,
    tool_constraint: StructuredOutputSpec | None = None, default_constraint: StructuredOutputSpec | None = None,
    echo: EchoOptions | None = None,
) -> SamplingParams:
    """The domain SamplingParams an OpenAI request asks for. Where it is silent: the model's defaults
    (filled by the pod, vLLM's --generation-config auto) for the fields it may set, else OpenAI's.
    default_max_tokens: max_tokens when the request names none; chat takes the model's max_new_tokens
    before it, completions never do (vLLM's completions request holds 16 as if the client sent it).
    tool_constraint: the structured output a forced tool_choice needs; default_constraint: the one when the
    request names none ("auto" tool choice's grammar); echo: a completion's echo (its logprobs cover the
    prompt too)."""
    kwargs: dict[str, Any] = {"temperature": OPENAI_DEFAULT_TEMPERATURE, "max_tokens": default_max_tokens}
    given = set()
    constraints = []
    for name, (param, parse) in SAMPLING_FIELDS.items():
        if body.get(name) is None:
            continue
        value = _parsed_field(parse, name, body[name])
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
    elif "structured_output" not in kwargs and default_constraint is not None:
        kwargs["structured_output"] = default_constraint
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
    except ValueError as exc:  # SamplingParams names the field first ("temperature must be ...")
        field_name = str(exc).split(" ", 1)[0]
        raise InvalidRequest(str(exc), field_name if field_name in SAMPLING_FIELDS else None) from None


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
                raise InvalidRequest(f"'{name}' is not supported by this server yet", name)
        elif name not in known:
            raise InvalidRequest(f"unknown field '{name}'", name)
        elif name in INFORMATIONAL_FIELDS and value is not None:
            _parsed_field(INFORMATIONAL_FIELDS[name], name, value)


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


def generate_inputs(body: dict[str, Any], prompts: list[str | list[int]], params: SamplingParams) -> list[GenerateInput]:
    """One generation input per prompt: a batch's prompts run as requests of their own, each with an id of
    its own."""
    request_id = body.get("request_id") or ""
    if not isinstance(request_id, str):
        raise InvalidRequest(f"request_id must be a string, got {shortened(request_id)}", "request_id")
    return [GenerateInput(prompt, params, f"{request_id}-{index}" if request_id and len(prompts) > 1 else request_id)
            for index, prompt in enumerate(prompts)]
