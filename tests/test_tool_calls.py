"""Function calling's request rules and the tool calls read back from text, whole and streamed in pieces."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from shared.serving.openai.messages import chat_messages
from shared.serving.openai.tool_calls import ToolCallParser, ToolChoice, tool_request
from shared.serving.pod.outcomes import InvalidRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


def request(parser=ToolCallParser.HERMES, **body):
    return tool_request({"tools": [WEATHER, TIME], **body}, parser)


def test_the_default_choice_is_auto_with_tools_and_nothing_without():
    assert request().choice is ToolChoice.AUTO
    assert tool_request({"messages": []}, None) is None
    assert tool_request({"tool_choice": "none"}, None) is None
    with pytest.raises(InvalidRequest, match="tool_choice needs tools"):
        tool_request({"tool_choice": "required"}, None)


def test_auto_without_a_parser_is_refused_naming_the_flag():
    with pytest.raises(InvalidRequest, match="--tool-call-parser"):
        request(parser=None)
    assert request(parser=None, tool_choice="required").choice is ToolChoice.REQUIRED
    assert request(parser=None, tool_choice="none").choice is ToolChoice.NONE


@pytest.mark.parametrize("body, message", [
    ({"tools": {}}, "non-empty list"),
    ({"tools": [{"type": "code_interpreter"}]}, r"tools\[0\] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON schema object"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools_and_choices_say_what_is_wrong(body, message):
    with pytest.raises(InvalidRequest, match=message):
        tool_request(body, ToolCallParser.HERMES)


def test_a_named_choice_constrains_to_that_functions_arguments():
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().json_schema) == WEATHER["function"]["parameters"]
    no_parameters = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(no_parameters.constraint().json_schema) == {"type": "object", "properties": {},
                                                                  "additionalProperties": False}
    assert named.calls_in('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    assert named.finish_reason("stop", True) == "stop"  # as OpenAI answers a forced call
    assert request().constraint() is None and request(tool_choice="none").constraint() is None


def test_required_constrains_to_a_list_of_calls_of_the_tools():
    schema = json.loads(request(tool_choice="required").constraint().json_schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(request(tool_choice="required", parallel_tool_calls=False).constraint().json_schema)
    assert single["maxItems"] == 1
    required = request(tool_choice="required")
    content, calls = required.calls_in('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert required.finish_reason("stop", True) == "tool_calls"
    assert required.calls_in('[{"name": "get_wea') == ('[{"name": "get_wea', [])  # cut short: text


def test_required_moves_the_parameters_definitions_to_the_root_where_their_refs_resolve():
    unit = {"enum": ["c", "f"]}
    tool = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}}
    schema = json.loads(tool_request({"tools": [tool], "tool_choice": "required"}, None).constraint().json_schema)
    assert schema["$defs"] == {"Unit": unit}
    jsonschema.validate([{"name": "t", "parameters": {"unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "t", "parameters": {"unit": "k"}}], schema)
    clash = {"type": "function", "function": {"name": "u", "parameters": {"$defs": {"Unit": {"type": "string"}}}}}
    with pytest.raises(InvalidRequest, match="twice"):
        tool_request({"tools": [tool, clash], "tool_choice": "required"}, None).constraint()


HERMES_CASES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Å"}}</tool_call>', None, [("get_time", {}), ("get_weather", {"city": "Å"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # unclosed at the end
    ('\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),  # no content
    ("No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),  # not JSON: text
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "get_time", "arguments": {}}; {"name": "get_time", "parameters": {}}', None,
     [("get_time", {}), ("get_time", {})]),
    ("  The weather is fine {not json}", "  The weather is fine {not json}", []),
    ('{"name": "get_weather", "parameters": {"city"', '{"name": "get_weather", "parameters": {"city"', []),
]


@pytest.mark.parametrize("parser, text, content, calls", [
    *((ToolCallParser.HERMES, *case) for case in HERMES_CASES),
    *((ToolCallParser.LLAMA3_JSON, *case) for case in LLAMA_CASES),
])
def test_auto_reads_calls_in_the_parsers_format_whole_and_streamed_alike(parser, text, content, calls):
    auto = request(parser=parser)
    whole_content, whole_calls = auto.calls_in(text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    assert auto.finish_reason("stop", bool(calls)) == ("tool_calls" if calls else "stop")
    rng = random.Random(0)
    for _ in range(20):  # the same text in random pieces streams the same content and calls
        stream, streamed, streamed_calls, at = auto.stream(), "", [], 0
        while at < len(text):
            size = rng.randint(1, 6)
            delta = stream.push(text[at:at + size])
            at += size
            assert not delta.tool_calls
            streamed += delta.content
        end = stream.finish()
        streamed += end.content
        assert streamed == (content or "")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in end.tool_calls] == calls
        assert [c["index"] for c in end.tool_calls] == list(range(len(calls)))
        assert stream.found_calls == bool(calls)


def test_content_streams_before_a_call_and_waits_only_where_a_tag_may_begin():
    stream = request().stream()
    assert stream.push("Sure, ").content == "Sure, "
    assert stream.push("one moment <tool").content == "one moment "  # may begin <tool_call>
    assert stream.push("s are fun").content == "<tools are fun"
    llama = request(parser=ToolCallParser.LLAMA3_JSON).stream()
    assert llama.push("  ").content == ""  # undecided: whitespace could lead a call
    assert llama.push("Hello").content == "  Hello"
    assert llama.push(" {x}").content == " {x}"


def test_a_named_call_streams_its_arguments_as_they_come():
    stream = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}).stream()
    first = stream.push('{"ci')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert first.tool_calls[0]["id"].startswith("call_") and first.tool_calls[0]["type"] == "function"
    assert stream.push('ty": "Oslo"}').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert stream.found_calls and stream.finish().tool_calls == []


def test_required_streams_its_calls_at_the_end():
    stream = request(tool_choice="required").stream()
    assert stream.push('[{"name": "get_time", ').content == ""
    end = stream.push('"parameters": {}}]').content, stream.finish()
    assert end[0] == "" and end[1].tool_calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_an_assistants_call_arguments_reach_the_template_as_an_object():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    converted = chat_messages({"messages": messages})
    assert converted[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert converted[0] == messages[0] and converted[2] == messages[2]
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{oops"
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        chat_messages({"messages": messages})


def test_vllms_readings_empty_tools_no_parameters_and_a_forced_call_over_a_response_format():
    from shared.serving.openai.protocol import sampling_params_from_openai

    assert tool_request({"tools": []}, None) is None  # LangChain's bind_tools([])
    no_parameters = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    schema = json.loads(no_parameters.constraint().json_schema)
    jsonschema.validate({}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"invented": 1}, schema)
    required = request(tool_choice="required")
    params = sampling_params_from_openai({"response_format": {"type": "json_object"}},
                                         tool_constraint=required.constraint())
    assert params.structured_output == required.constraint()
