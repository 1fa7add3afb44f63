"""The grammar "auto" tool choice generates under: free text, or tool calls in the --tool-call-parser's format
whose arguments follow their tool's schema (undeclared keys refused unless the schema allows them, as for a
named call). A Lark grammar for llguidance: each call's arguments are a `%json` of its tool's parameters."""
from __future__ import annotations

import json
from typing import Any

from shared.engine.closed_schema import closed_objects

# The separators Hermes/Qwen and Llama write their calls with (json.dumps'), and no other whitespace: the model
# stays in the format it was trained on and cannot wander off into endless blanks.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_TEXT = r"/(.|\n)*/"
_STARTS_THINKING = r"/[ \t\r\n]*<think>(.|\n)*/"


def auto_tool_grammar(parser_name: str, parameters: dict[str, dict[str, Any]], parallel: bool,
                      opens_thinking: bool | None) -> str:
    """The Lark grammar of an "auto" answer. parser_name: "hermes" or "llama3_json"; parameters: each tool's
    parameters schema by name; parallel: more than one call allowed; opens_thinking: None without a reasoning
    parser, else whether the prompt ends inside an open <think> (the thinking comes first and is free text)."""
    # Where the model may think or not, the answer's text may not start a thinking of its own: else a
    # `<tool_call>` mentioned while thinking would start a call there.
    not_thinking = f" & ~{_STARTS_THINKING}" if opens_thinking is False else ""
    calls = {"hermes": _hermes_rules, "llama3_json": _llama3_json_rules}[parser_name](parameters, parallel, not_thinking)
    lines = ["%llguidance {}", *_thinking_rules(opens_thinking), *calls]
    for index, (name, schema) in enumerate(parameters.items()):
        lines.append(f"args_{index}: %json {json.dumps(_arguments_schema(schema))}")
    return "\n".join(lines) + "\n"


def _arguments_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {**closed_objects(schema), "x-guidance": _JSON_STYLE}


def _thinking_rules(opens_thinking: bool | None) -> list[str]:
    """`start`: the thinking (free text up to the first </think>), then the answer."""
    if opens_thinking is None:
        return ["start: answer"]
    if opens_thinking:
        return ["start: thought answer", f'thought[lazy]: {_ANY_TEXT} "</think>"']
    return ["start: answer | thought answer", 'thought[lazy]: THINKING "</think>"', f"THINKING: {_STARTS_THINKING}"]


def _hermes_rules(parameters: dict[str, dict[str, Any]], parallel: bool, not_thinking: str) -> list[str]:
    """Text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (more on the lines after,
    when parallel). The text ends where `<tool_call>` first appears: from there on it is a call."""
    more = ' ("\\n" "<tool_call>" call)*' if parallel else ""
    lines = ["answer: PLAIN_TEXT | calls", f"PLAIN_TEXT: {_ANY_TEXT}{not_thinking}", f"calls: call_open call{more}",
             'call_open[lazy]: PLAIN_TEXT "<tool_call>"',
             "call: " + " | ".join(f"call_{index}" for index in range(len(parameters)))]
    for index, name in enumerate(parameters):
        opening = json.dumps(f'\n{{"name": {json.dumps(name)}, "arguments": ')
        lines.append(f'call_{index}: {opening} args_{index} "}}\\n</tool_call>"')
    return lines


def _llama3_json_rules(parameters: dict[str, dict[str, Any]], parallel: bool, not_thinking: str) -> list[str]:
    """Either text that does not start with "{" (content), or the whole output is calls:
    `{"name": ..., "parameters": {...}}`, several separated by "; " when parallel."""
    more = ' ("; " call)*' if parallel else ""
    lines = ["answer: CONTENT | calls", r"CONTENT: /[ \t\r\n]*([^{ \t\r\n](.|\n)*)?/" + not_thinking, r"BLANKS: /[ \t\r\n]+/",
             f"calls: BLANKS? call{more}", "call: " + " | ".join(f"call_{index}" for index in range(len(parameters)))]
    for index, name in enumerate(parameters):
        opening = json.dumps(f'{{"name": {json.dumps(name)}, "parameters": ')
        lines.append(f'call_{index}: {opening} args_{index} "}}"')
    return lines
