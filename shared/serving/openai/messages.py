"""Chat messages as OpenAI defines them, read as vLLM and transformers read them: each message checked
(the field to blame named), its content as text (null is "", text parts joined by newlines), an assistant's
tool call arguments as objects, and its `name`, `tool_call_id` and reasoning kept; the template options."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shared.serving.openai.protocol import boolean, shortened
from shared.serving.pod.outcomes import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# The text part types vLLM takes, and the field holding each one's text.
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                     "thinking": "thinking"}
# An assistant's reasoning, by each name clients send it under (the template reads them all).
_REASONING_FIELDS = ("reasoning", "reasoning_content", "thinking")
# reasoning_effort's values, as vLLM takes them ("max" is DeepSeek V4's).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as the chat template gets them; InvalidRequest naming the field that is wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    return [_template_message(f"messages[{index}]", message) for index, message in enumerate(messages)]


def _template_message(where: str, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where} must be an object with a 'role'", where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {shortened(role)}", f"{where}.role")
    content = message.get("content")
    if content is None and role != "assistant":  # an assistant's turn may be tool calls alone
        raise InvalidRequest(f"{where}.content is required in a {role} message", f"{where}.content")
    result: dict[str, Any] = {"role": role, "content": _content_text(f"{where}.content", content)}
    for name in ("name", "tool_call_id", *(_REASONING_FIELDS if role == "assistant" else ())):
        if message.get(name) is not None:
            result[name] = _string(f"{where}.{name}", message[name])
    if role == "assistant" and message.get("tool_calls") is not None:
        result["tool_calls"] = _tool_calls(f"{where}.tool_calls", message["tool_calls"])
    return result


def _content_text(where: str, content: Any) -> str:
    """A content as text: null is "", a list of parts their texts joined by newlines (vLLM's "string" format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts, got {shortened(content)}", where)
    return "\n".join(_part_text(f"{where}[{index}]", part) for index, part in enumerate(content))


def _part_text(where: str, part: Any) -> str:
    if isinstance(part, str):  # vLLM takes a bare string as a text part
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    text_field = _TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
    if text_field is None:
        raise InvalidRequest(f"{where}.type: only text parts are supported (this server is text only), got "
                             f"{shortened(kind if kind is not None else part)}", f"{where}.type")
    return _string(f"{where}.{text_field}", part.get(text_field))


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string, got {shortened(value)}", where)
    return value


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant's tool calls, their arguments as objects, not the JSON text OpenAI sends (vLLM turns
    them so too, for the templates)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", where)
    return [_call_with_argument_object(f"{where}[{index}]", call) for index, call in enumerate(calls)]


def _call_with_argument_object(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                             where)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{where}.function.arguments is not valid JSON: {exc}",
                                 f"{where}.function.arguments") from None
    return {**call, "function": {**function, "arguments": arguments}}


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
        raise InvalidRequest(f"chat_template_kwargs must be an object, got {shortened(variables)}",
                             "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        # vLLM's reading: the template gets reasoning_effort, and enable_thinking unless the caller set it.
        if effort not in REASONING_EFFORTS:
            raise InvalidRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                                 f"{shortened(effort)}", "reasoning_effort")
        variables = {"enable_thinking": effort != "none", **variables, "reasoning_effort": effort}
    return ChatTemplateOptions(
        add_generation_prompt=True if add_generation_prompt is None else boolean("add_generation_prompt",
                                                                                  add_generation_prompt),
        continue_final_message=continue_final_message is not None and boolean("continue_final_message",
                                                                               continue_final_message),
        template_variables=variables,
    )
