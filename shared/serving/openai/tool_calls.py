"""OpenAI function calling on /v1/chat/completions, as vLLM serves it: the request's `tools` and
`tool_choice`, the structured-output constraint a forced choice becomes, and the tool calls read back from a
completion's text, whole or as it streams.

- "none" (the default without tools): plain text; the tools still reach the chat template.
- a named function: the output is that function's arguments (a JSON object of its parameters schema).
- "required": the output is a JSON list of {"name", "parameters"}, one or more of the tools.
- "auto" (the default with tools): the model writes text or calls in the --tool-call-parser's format
  (hermes: `<tool_call>{json}</tool_call>`, as Qwen2.5/Qwen3 and Hermes write them; llama3_json: a JSON
  object, or several separated by ";", as Llama 3.1+ write them), under a grammar that holds each call's
  arguments to its tool's schema (tool_grammar.py) unless the request names a structured output of its own;
  the parser finds the calls.
No web framework and no engine here; errors are InvalidRequest saying what is wrong."""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.engine.request import StructuredOutputSpec
from shared.serving.openai.tool_grammar import auto_tool_grammar
from shared.serving.pod.outcomes import InvalidRequest
from shared.serving.text import tag_start_at_end

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A function declared without parameters takes none (OpenAI's reading): its arguments are {}.
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFINITION_KEYS = ("$defs", "definitions")  # where JSON schemas keep what "$ref" points at


class ToolCallParser(enum.Enum):
    """The formats "auto" tool choice reads calls in (vLLM's --tool-call-parser names)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (as sent, for the chat template) and what it asks of them."""

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice
    named: str | None = None  # the function a named choice forces
    parallel: bool = True  # parallel_tool_calls: false keeps one call
    parser: ToolCallParser | None = None

    @property
    def parameters(self) -> dict[str, dict[str, Any]]:
        return {tool["function"]["name"]: tool["function"].get("parameters") or _EMPTY_PARAMETERS
                for tool in self.tools}

    def constraint(self) -> StructuredOutputSpec | None:
        """The structured output a forced choice needs; None for "none" and "auto"."""
        if self.choice is ToolChoice.NAMED:
            return StructuredOutputSpec(json_schema=json.dumps(self.parameters[self.named]))
        if self.choice is ToolChoice.REQUIRED:
            return StructuredOutputSpec(json_schema=json.dumps(_calls_schema(self.parameters, self.parallel)))
        return None

    def auto_constraint(self, opens_thinking: bool | None) -> StructuredOutputSpec | None:
        """For "auto": free text, or calls in the parser's format with arguments that follow their tool's
        schema (None for the other choices). opens_thinking: as auto_tool_grammar takes it."""
        if self.choice is not ToolChoice.AUTO:
            return None
        return StructuredOutputSpec(grammar=auto_tool_grammar(self.parser.value, self.parameters, self.parallel,
                                                              opens_thinking))

    @property
    def reads_calls(self) -> bool:
        """Whether the completion's text is read for tool calls."""
        return self.choice is not ToolChoice.NONE

    def stream(self) -> "ToolCallStream":
        """A reader of one completion's text as it arrives."""
        if self.choice is ToolChoice.NAMED:
            return _NamedStream(self.named)
        return _BufferedStream(self)

    def calls_in(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """The content and the tool calls of a whole completion's text (calls empty: all of it is content)."""
        if self.choice is ToolChoice.NAMED:
            return None, [FunctionCall(self.named, text)]
        if self.choice is ToolChoice.REQUIRED:
            calls = _required_calls(text)
        elif self.choice is ToolChoice.AUTO:
            content, calls = _PARSERS[self.parser](text)
            if calls:
                return content, calls if self.parallel else calls[:1]
        else:
            calls = []
        return (None, calls) if calls else (text, [])

    def finish_reason(self, engine_reason: str | None, found_calls: bool) -> str | None:
        """vLLM's rule: "tool_calls" when the model called tools of its own ("auto") or as "required" asked,
        and stopped by itself; a named call keeps the engine's reason, as OpenAI does."""
        if found_calls and engine_reason == "stop" and self.choice in (ToolChoice.AUTO, ToolChoice.REQUIRED):
            return "tool_calls"
        return engine_reason


def tool_request(body: dict[str, Any], parser: ToolCallParser | None) -> ToolRequest | None:
    """What a chat request asks of tools; None when it sends none. InvalidRequest says what is wrong."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools == []:
        tools = None  # as vLLM takes it (LangChain's bind_tools([]) sends it)
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools")
        return None
    tools = _checked_tools(tools)
    choice, named = _checked_choice("auto" if choice is None else choice, tools)
    if choice is ToolChoice.AUTO and parser is None:
        raise InvalidRequest('tool_choice "auto" (the default with tools) needs the server started with '
                             f"--tool-call-parser ({', '.join(p.value for p in ToolCallParser)}); "
                             'or send tool_choice "required", "none" or a named function')
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(f"parallel_tool_calls must be true or false, got {parallel!r}")
    return ToolRequest(tools, choice, named, parallel is not False, parser)


def _checked_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise InvalidRequest(f"{where}: two tools are named '{name}'")
        names.add(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string")
    return tuple(tools)


def _checked_choice(choice: Any, tools: tuple[dict[str, Any], ...]) -> tuple[ToolChoice, str | None]:
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice), None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise InvalidRequest(f"tool_choice names the function '{name}', which is not among the tools")
    return ToolChoice.NAMED, name


def _calls_schema(parameters: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A list of one or more {"name": a tool, "parameters": its arguments}. Definitions the parameters'
    "$ref"s point at ("#/$defs/..." from each schema's root) move to this schema's root, where those
    references now resolve."""
    definitions: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITION_KEYS}
    choices = []
    for name, schema in parameters.items():
        schema = dict(schema)
        for key in _DEFINITION_KEYS:
            for definition, value in (schema.pop(key, None) or {}).items():
                if definitions[key].setdefault(definition, value) != value:
                    raise InvalidRequest(f"tools define '{key}/{definition}' twice, differently")
        # No other keys: a call ends once it has both (vLLM leaves it open, so a model may ramble on).
        choices.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                          "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False})
    result: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel:
        result["maxItems"] = 1
    result.update({key: value for key, value in definitions.items() if value})
    return result


def _required_calls(text: str) -> list[FunctionCall]:
    """The calls of a "required" completion (none when it was cut short and is not whole JSON)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    return [FunctionCall(item["name"], _arguments_text(item["parameters"])) for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# ---- the model formats "auto" reads -----------------------------------------------------------

_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_LLAMA_PYTHON_TAG = "<|python_tag|>"


def _hermes_calls(text: str) -> tuple[str | None, list[FunctionCall]]:
    """Text, then one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the last may be
    unclosed at the end of the output). Any call that is not such JSON makes the whole text content."""
    start = text.find(_HERMES_OPEN)
    if start == -1:
        return text, []
    calls = [_named_call(match.group(1).strip(), "arguments") for match in _HERMES_CALL.finditer(text, start)]
    if not calls or None in calls:
        return text, []
    return text[:start] if text[:start].strip() else None, calls


def _llama3_json_calls(text: str) -> tuple[str | None, list[FunctionCall]]:
    """The whole output is `{"name": ..., "parameters": {...}}` (or "arguments"), maybe after Llama's
    <|python_tag|>, several separated by ";". Anything else is content."""
    body = text.strip().removeprefix(_LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            item, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _named_call_of(item, "parameters") or _named_call_of(item, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return None, calls


def _named_call(text: str, arguments_key: str) -> FunctionCall | None:
    try:
        return _named_call_of(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _named_call_of(item: Any, arguments_key: str) -> FunctionCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or arguments_key not in item:
        return None
    return FunctionCall(item["name"], _arguments_text(item[arguments_key]))


_PARSERS = {ToolCallParser.HERMES: _hermes_calls, ToolCallParser.LLAMA3_JSON: _llama3_json_calls}


def _hermes_content_end(text: str) -> tuple[int, bool]:
    """(How much of the text so far is surely content, whether calls begin there): content until the
    opening tag, held back while the text ends with what could begin it, and while it is only whitespace
    (before a call, that is no content)."""
    start = text.find(_HERMES_OPEN)
    calls_begin = start != -1
    end = start if calls_begin else len(text) - tag_start_at_end(text, _HERMES_OPEN)
    return (end if text[:end].strip() else 0), calls_begin


def _llama3_json_content_end(text: str) -> tuple[int, bool]:
    """Calls are the whole output, so its first characters decide: a JSON object (or the python tag) is
    calls; anything else makes all of it content."""
    body = text.lstrip()
    if body.startswith(("{", _LLAMA_PYTHON_TAG)):
        return 0, True
    if not body or _LLAMA_PYTHON_TAG.startswith(body):
        return 0, False  # undecided yet
    return len(text), False


_CONTENT_END = {ToolCallParser.HERMES: _hermes_content_end, ToolCallParser.LLAMA3_JSON: _llama3_json_content_end}


# ---- streaming --------------------------------------------------------------------------------


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_objects(calls: list[FunctionCall], streamed: bool = False) -> list[dict[str, Any]]:
    """The calls as OpenAI writes them (streamed deltas also name their index)."""
    objects = []
    for index, call in enumerate(calls):
        entry = {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        objects.append({"index": index, **entry} if streamed else entry)
    return objects


@dataclass
class StreamDelta:
    """What one piece of a completion's text becomes on the stream."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """One completion's text read for tool calls as it arrives."""

    found_calls = False

    def push(self, text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        """What was held back, once the completion ended."""
        raise NotImplementedError


class _NamedStream(ToolCallStream):
    """A named call: the text is its arguments, streamed as they come (the first delta names the call)."""

    def __init__(self, name: str):
        self._name = name
        self.found_calls = True
        self._has_started = False

    def push(self, text: str) -> StreamDelta:
        if self._has_started:
            return StreamDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])
        self._has_started = True
        return StreamDelta(tool_calls=tool_call_objects([FunctionCall(self._name, text)], streamed=True))

    def finish(self) -> StreamDelta:
        return StreamDelta()


class _BufferedStream(ToolCallStream):
    """"required" and "auto": calls are read from whole text, so from where they may begin the text waits
    for the end of the completion; content before that streams as it comes ("auto" only, as far as the
    parser's format tells it is content). At the end the same reading as a whole response decides."""

    def __init__(self, request: ToolRequest):
        self._request = request
        self._text = ""
        self._num_sent = 0
        self._content_end = _CONTENT_END[request.parser] if request.choice is ToolChoice.AUTO else None

    def push(self, text: str) -> StreamDelta:
        self._text += text
        if self._content_end is None:
            return StreamDelta()
        end, calls_begin = self._content_end(self._text)
        if calls_begin:
            self._content_end = None  # the rest waits for the end
        return StreamDelta(content=self._take(end))

    def finish(self) -> StreamDelta:
        content, calls = self._request.calls_in(self._text)
        self.found_calls = bool(calls)
        if not calls:
            return StreamDelta(content=self._take(len(self._text)))
        return StreamDelta(content=self._take(len(content or "")), tool_calls=tool_call_objects(calls, streamed=True))

    def _take(self, end: int) -> str:
        piece = self._text[self._num_sent:end] if end > self._num_sent else ""
        self._num_sent = max(self._num_sent, end)
        return piece
