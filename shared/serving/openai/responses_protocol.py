"""OpenAI's Responses API (/v1/responses) as a presentation of the chat path: a request becomes a chat
request (input items as messages, `instructions` as the system message, function tools and tool_choice,
text.format as response_format), and the chat answer becomes Response output items (reasoning, message,
function_call), whole or as Responses stream events. Nothing is stored: a request that refers to an earlier
response (previous_response_id, conversation) or asks for hosted tools is refused by name. No web framework
here; errors are InvalidRequest saying what is wrong."""
from __future__ import annotations

import time
import uuid
from typing import Any

from shared.serving.openai.messages import REASONING_EFFORTS
from shared.serving.openai.protocol import INFORMATIONAL_FIELDS, SAMPLING_FIELDS, UNSUPPORTED_FIELDS, boolean
from shared.serving.pod.outcomes import InvalidRequest

# Responses fields this server does not honour, with the value that asks for nothing.
_UNSUPPORTED = {
    "previous_response_id": None, "conversation": None, "background": False, "prompt": None,
    "max_tool_calls": None, "stream_options": None,
}
# The include value that asks for the output text's logprobs (top_logprobs says how many alternatives).
_LOGPROBS = "message.output_text.logprobs"
# truncation "auto" drops the oldest input items only when the input overflows the context; an input that
# fits is served as with "disabled". This server drops none: an overflowing input is refused for its length.
_TRUNCATIONS = ("auto", "disabled")
# Fields that change nothing in the output (accepted, echoed where the Response has them).
_INFORMATIONAL = ("model", "store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "safety_identifier")
# Chat sampling fields a Responses request may also carry (vLLM takes them as extras), besides its own.
_CHAT_EXTRAS = tuple(name for name in SAMPLING_FIELDS
                     if name not in ("max_tokens", "max_completion_tokens", "n", "response_format"))
_TEXT_PART_TYPES = ("input_text", "output_text", "text")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request asks for. InvalidRequest names what cannot be served."""
    _check_fields(body)
    is_streaming = body.get("stream") is not None and boolean("stream", body["stream"])
    chat: dict[str, Any] = {"messages": _messages(body), "stream": is_streaming}
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise InvalidRequest(f"tools must be a list of function tools, got {body['tools']!r:.200}", "tools")
        chat["tools"] = [_chat_tool(index, tool) for index, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format((body.get("text") or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    if _LOGPROBS in (body.get("include") or []):
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    chat.update({name: body[name] for name in _CHAT_EXTRAS if body.get(name) is not None})
    return chat


def _check_fields(body: dict[str, Any]) -> None:
    own = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls", "text",
           "stream", "reasoning", "truncation", "include", "top_logprobs", *_INFORMATIONAL)
    unsupported = {**UNSUPPORTED_FIELDS, **_UNSUPPORTED}  # with the value that asks for nothing
    for name, value in body.items():
        if name in unsupported and name not in own:
            if value is not None and value != unsupported[name]:
                raise InvalidRequest(f"'{name}' is not supported by this server", name)
        elif name not in own and name not in _CHAT_EXTRAS:
            raise InvalidRequest(f"unknown field '{name}'", name)
        elif name in INFORMATIONAL_FIELDS and value is not None:
            INFORMATIONAL_FIELDS[name](name, value)
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or set(text) - {"format", "verbosity"}
                             or text.get("verbosity") not in (None, "medium")):
        raise InvalidRequest("text must be {'format': {...}} (verbosity other than the default 'medium' is not "
                             "supported)", "text")
    include = body.get("include") or []
    if not isinstance(include, list) or set(include) - {_LOGPROBS}:
        raise InvalidRequest(f"include takes only {_LOGPROBS!r} here, got {include!r:.200}", "include")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in _TRUNCATIONS:
        raise InvalidRequest(f"truncation must be one of {', '.join(_TRUNCATIONS)}, got {truncation!r:.200}", "truncation")


def _reasoning_effort(reasoning: Any) -> str | None:
    """reasoning.effort, which chat takes as reasoning_effort (the template's, as vLLM passes it). A summary
    of the model's reasoning is not written by this server, so asking for one is refused."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise InvalidRequest(f"reasoning must be {{'effort': ...}}, got {reasoning!r:.200}", "reasoning")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise InvalidRequest(f"'reasoning.{name}' is not supported by this server", f"reasoning.{name}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r:.200}",
                             "reasoning.effort")
    return effort


# ---- input items -> chat messages ------------------------------------------------------------


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a non-empty string or list of items")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        _add_item(messages, f"input[{index}]", item)
    return messages


def _add_item(messages: list[dict[str, Any]], where: str, item: Any) -> None:
    """One input item as chat messages: a message; a function call (joined to the assistant turn it belongs
    to); a function call's output (a tool message). A reasoning item of an earlier turn is left out, as
    chat templates leave out earlier turns' thinking."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message" and "role" in item:
        role = "system" if item["role"] == "developer" else item["role"]
        if role not in ("system", "user", "assistant"):
            raise InvalidRequest(f"{where}.role must be user, assistant, system or developer, got {item['role']!r:.200}",
                                 f"{where}.role")
        messages.append({"role": role, "content": _text_of(f"{where}.content", item.get("content"))})
    elif kind == "function_call":
        call = {"id": _string(f"{where}.call_id", item.get("call_id")), "type": "function",
                "function": {"name": _string(f"{where}.name", item.get("name")),
                             "arguments": _string(f"{where}.arguments", item.get("arguments"))}}
        if not messages or messages[-1]["role"] != "assistant" or "tool_calls" not in messages[-1]:
            messages.append({"role": "assistant", "content": None, "tool_calls": []})
        messages[-1]["tool_calls"].append(call)
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(f"{where}.call_id", item.get("call_id")),
                         "content": _text_of(f"{where}.output", item.get("output"))})
    elif kind != "reasoning":
        raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported (messages, function_call "
                             "and function_call_output are)")


def _text_of(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        is_text = isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str)
        if not is_text:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}[{index}]: only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string")
    return value


# ---- tools and formats -------------------------------------------------------------------------


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) in chat's shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidRequest(f"tools[{index}]: only function tools are supported, got {kind!r}", f"tools[{index}]")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                         f"got {choice!r:.200}", "tool_choice")


def _response_format(text_format: Any) -> dict[str, Any] | None:
    if text_format is None or text_format == {"type": "text"}:
        return None
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": text_format.get("name", "output"),
                                                       "schema": text_format.get("schema")}}
    raise InvalidRequest(f"text.format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, "
                         f"got {text_format!r:.200}", "text.format")


# ---- chat answer -> Response ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShell:
    """The fields every Response object of one request carries: its id and the request's settings."""

    def __init__(self, body: dict[str, Any], model: str):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._fields = {
            "model": model, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "metadata": body.get("metadata") or {}, "user": body.get("user"), "store": False,
            "previous_response_id": None, "reasoning": body.get("reasoning"),
            "truncation": body.get("truncation") or "disabled",
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        """The Response object; a completion cut at max_output_tokens is "incomplete", as OpenAI says."""
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": _usage(usage) if usage is not None else None, **self._fields,
        }


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def output_items(message: dict[str, Any], logprobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A chat answer's message as Response output items: its reasoning, its text (with the chat choice's
    logprobs, when asked for), its function calls."""
    items = []
    if message.get("reasoning"):
        items.append(_reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content") or not message.get("tool_calls"):
        items.append(_message_item(new_id("msg"), message.get("content") or "", "completed",
                                   (logprobs or {}).get("content") or []))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                                "completed"))
    return items


def _message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    """An output_text part; logprobs: chat's per-token entries, whose shape Responses shares."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


class ResponseEvents:
    """Chat stream chunks of one completion as Responses stream events: each output item opened, its text or
    arguments as they come, closed, then the whole Response. Thinking goes out as one reasoning item once
    it ends (its text streams nowhere else)."""

    def __init__(self, shell: ResponseShell):
        self._shell = shell
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # finished items, in order
        self._reasoning = ""
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its open function_call item
        self._logprobs: list[dict[str, Any]] = []  # chat's logprobs entries not yet sent with text

    def started(self) -> list[dict[str, Any]]:
        response = self._shell.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk's choice (its delta)."""
        delta, events = choice.get("delta") or {}, []
        self._reasoning += delta.get("reasoning") or ""
        self._logprobs += (choice.get("logprobs") or {}).get("content") or []
        if delta.get("content"):
            events += self._close_reasoning()
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            self._logprobs = []  # a call's tokens: no output text's
            events += self._close_reasoning()
            events += self._call(call)
        return events

    def finished(self, finish_reason: str | None, usage: dict[str, int] | None) -> list[dict[str, Any]]:
        events = self._close_reasoning() + self._close_message()
        for index in sorted(self._calls):
            events += self._close_call(self._calls.pop(index))
        response = self._shell.response("completed", self._output, usage, finish_reason)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def failed(self, message: str, code: str) -> list[dict[str, Any]]:
        return [self._event("error", message=message, code=code, param=None)]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"id": new_id("msg"), "text": "", "index": len(self._output), "logprobs": []}
            events += [self._event("response.output_item.added", output_index=self._message["index"],
                                   item=_message_item(self._message["id"], None, "in_progress")),
                       self._event("response.content_part.added", **self._at_text(), part=_text_part(""))]
        self._message["text"] += text
        logprobs, self._logprobs = self._logprobs, []
        self._message["logprobs"] += logprobs
        return [*events, self._event("response.output_text.delta", **self._at_text(), delta=text, logprobs=logprobs)]

    def _at_text(self) -> dict[str, Any]:
        return {"item_id": self._message["id"], "output_index": self._message["index"], "content_index": 0}

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message, at = self._message, self._at_text()
        text, logprobs = message["text"], message["logprobs"] + self._logprobs
        self._message, self._logprobs = None, []
        item = _message_item(message["id"], text, "completed", logprobs)
        self._output.append(item)
        return [self._event("response.output_text.done", **at, text=text, logprobs=logprobs),
                self._event("response.content_part.done", **at, part=_text_part(text, logprobs)),
                self._event("response.output_item.done", output_index=message["index"], item=item)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        state = self._calls.get(call["index"])
        if state is None:
            events += self._close_message()
            function = call["function"]
            state = self._calls[call["index"]] = {"id": new_id("fc"), "call_id": call["id"], "name": function["name"],
                                                  "arguments": "", "index": len(self._output) + len(self._calls)}
            events.append(self._event("response.output_item.added", output_index=state["index"],
                                      item=_call_item(state["id"], state["call_id"], state["name"], "", "in_progress")))
        arguments = call["function"].get("arguments") or ""
        if arguments:
            state["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=state["id"],
                                      output_index=state["index"], delta=arguments))
        return events

    def _close_call(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        item = _call_item(state["id"], state["call_id"], state["name"], state["arguments"], "completed")
        self._output.append(item)
        return [self._event("response.function_call_arguments.done", item_id=state["id"], output_index=state["index"],
                            name=state["name"], arguments=state["arguments"]),
                self._event("response.output_item.done", output_index=state["index"], item=item)]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if not self._reasoning:
            return []
        item = _reasoning_item(new_id("rs"), self._reasoning)
        self._reasoning = ""
        index = len(self._output)
        self._output.append(item)
        return [self._event("response.output_item.added", output_index=index, item={**item, "content": []}),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence, **fields}
