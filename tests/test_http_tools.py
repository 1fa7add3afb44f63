"""Function calling over HTTP through the official `openai` client: a named function, "required" and
"auto" (read by the hermes parser), whole and streamed, colocated and split. The tiny preset has random
weights, so "auto" is steered into writing a call with guided_regex; named and "required" calls are
constrained by the tools' own schemas."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from shared.serving.openai.config import HttpConfig
from pdserve.launcher import LocalCluster
from shared.serving.openai.tool_calls import ToolCallParser
from shared.serving.text import TextCodec
from split_cluster import MODEL_ARGS
from tests.test_http_api import _all_free, _wait_pods_idle, _wait_until, colocated_http

pytestmark = pytest.mark.e2e

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
        "required": ["unit", "hourly"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def _streamed_calls(chunks) -> tuple[str, list[tuple[str, dict]]]:
    """The content and the calls a stream of chat chunks adds up to (arguments joined per call index)."""
    content, names, arguments, ids = "", {}, {}, {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id:
                ids[call.index] = call.id
            if call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert sorted(ids) == sorted(names)
    return content, [(names[i], json.loads(arguments[i])) for i in sorted(names)]


async def _chat(client, stream: bool, **kwargs):
    answer = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0,
                                                  max_tokens=60, stream=stream, **kwargs)
    if not stream:
        return answer
    return [chunk async for chunk in answer]


@pytest.mark.timeout(180)
def test_colocated_named_required_and_auto_tool_calls_whole_and_streamed():
    async def scenario():
        async with colocated_http(config=HttpConfig(tool_call_parser=ToolCallParser.HERMES)) as (client, pod, _):
            named = await _chat(client, False, tool_choice=NAMED)
            [(name, arguments)] = _calls(named.choices[0].message)
            assert name == "get_weather" and named.choices[0].message.content is None
            jsonschema.validate(arguments, UNIT)
            assert named.choices[0].finish_reason == "stop"
            content, calls = _streamed_calls(await _chat(client, True, tool_choice=NAMED))
            assert (content, calls) == ("", _calls(named.choices[0].message))

            required = await _chat(client, False, tool_choice="required")
            calls = _calls(required.choices[0].message)
            assert calls and required.choices[0].finish_reason == "tool_calls"
            for name, arguments in calls:
                jsonschema.validate(arguments, {tool["function"]["name"]: tool["function"]["parameters"]
                                                for tool in TOOLS}[name])
            chunks = await _chat(client, True, tool_choice="required")
            assert _streamed_calls(chunks) == ("", calls)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

            steered = {"guided_regex": r"Checking\.\n" + _regex_of(HERMES_CALL)}
            auto = await _chat(client, False, extra_body=steered)
            assert auto.choices[0].message.content == "Checking.\n"
            assert _calls(auto.choices[0].message) == [("get_time", {"utc": True})]
            assert auto.choices[0].finish_reason == "tool_calls"
            chunks = await _chat(client, True, extra_body=steered)
            assert _streamed_calls(chunks) == ("Checking.\n", [("get_time", {"utc": True})])
            plain = await _chat(client, False, tool_choice="none")  # tools shown to the template, not read
            assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"

            # The model's answer goes back with the tool's result, as an agent loop sends it.
            history = [*MESSAGES, named.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": named.choices[0].message.tool_calls[0].id, "content": "sunny"}]
            follow_up = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                             tool_choice="none", max_tokens=4)
            assert follow_up.usage.prompt_tokens > named.usage.prompt_tokens
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def _regex_of(text: str) -> str:
    """A regular expression matching exactly text."""
    return "".join("\\n" if char == "\n" else f"\\{char}" if char in r".^$*+?{}[]\|()" else char for char in text)


@pytest.mark.timeout(120)
def test_bad_tool_requests_are_400s_naming_the_problem():
    async def scenario():
        async with colocated_http() as (client, pod, _):  # no --tool-call-parser
            cases = [
                (dict(tools=TOOLS), '"auto"'),
                (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
                (dict(tool_choice="required"), "tool_choice needs tools"),
                (dict(tools=TOOLS, tool_choice="required", extra_body={"guided_regex": "a", "guided_json": {}}),
                 "one structured-output constraint"),
                (dict(tools=[{"type": "function", "function": {"name": "has space"}}], tool_choice="required"),
                 "function.name"),
            ]
            for kwargs, needle in cases:
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
                assert needle in info.value.body["message"], (kwargs, info.value.body)
            broken_history = [*MESSAGES, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{utc"}}]}]
            with pytest.raises(openai.BadRequestError, match="not valid JSON"):
                await client.chat.completions.create(model="tiny", messages=broken_history, max_tokens=4)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def test_split_tool_calls_match_the_colocated_server(split_cluster):
    """The router (started with --tool-call-parser hermes) answers tool calls as the colocated server does."""
    async def colocated():
        async with colocated_http(config=HttpConfig(tool_call_parser=ToolCallParser.HERMES)) as (client, _, _url):
            return [_calls((await _chat(client, False, **kwargs)).choices[0].message) for kwargs in CHOICES]

    with openai.OpenAI(base_url=split_cluster.router.http_url, api_key="unused", max_retries=0) as client:
        split = []
        for kwargs in CHOICES:
            answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0,
                                                    max_tokens=60, **kwargs)
            split.append(_calls(answer.choices[0].message))
    assert split == asyncio.run(colocated())
    assert all(split)
    _wait_pods_idle(split_cluster)


CHOICES = [dict(tool_choice=NAMED), dict(tool_choice="required"),
           dict(extra_body={"guided_regex": _regex_of(HERMES_CALL)})]



def test_auto_calls_follow_the_tools_schemas_colocated_and_split(tmp_path):
    """Plain "auto" with the llama3_json parser, the model pushed to open with "{" (logit_bias): free, the
    tiny preset writes "{{{{..." and no call; under "auto"'s grammar a "{" can only open a call, so it writes
    one whose arguments follow the tool's schema. The router (--tool-call-parser llama3_json) sends the
    grammar to its pods: the split system writes the same call."""
    brace = TextCodec.from_path("tiny").tokenizer.token_to_id("{")
    ask = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=60,
               logit_bias={str(brace): 100}, parallel_tool_calls=False)

    async def colocated():
        async with colocated_http(config=HttpConfig(tool_call_parser=ToolCallParser.LLAMA3_JSON)) as (client, pod, _):
            answer = await client.chat.completions.create(**ask)
            await _wait_until(lambda: _all_free(pod))
            return answer

    answer = asyncio.run(colocated())
    [(name, arguments)] = _calls(answer.choices[0].message)
    jsonschema.validate(arguments, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])
    assert answer.choices[0].finish_reason == "tool_calls"
    with LocalCluster.start(pod_args=MODEL_ARGS, log_dir=tmp_path,
                            router_args=["--tokenizer", "tiny", "--tool-call-parser", "llama3_json"]) as cluster:
        with openai.OpenAI(base_url=cluster.router.http_url, api_key="unused", max_retries=0) as client:
            split = client.chat.completions.create(**ask)
    assert _calls(split.choices[0].message) == [(name, arguments)]
