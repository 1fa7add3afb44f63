"""OpenAI's Responses API (/v1/responses) through the official `openai` client: text, streamed events,
function tools (named, required, and calls read with --tool-call-parser), multi-turn input items with
function calls and their outputs, JSON output, and refusals of what a storeless server cannot do;
colocated and split give the same answers."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from shared.serving.openai.config import HttpConfig
from shared.serving.openai.reasoning import ReasoningParser
from shared.serving.openai.tool_calls import ToolCallParser
from tests.test_http_api import _all_free, _wait_pods_idle, _wait_until, colocated_http
from tests.test_http_tools import _regex_of

pytestmark = pytest.mark.e2e

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": UNIT}]
CONFIG = HttpConfig(tool_call_parser=ToolCallParser.HERMES, reasoning_parser=ReasoningParser.QWEN3)


def _items(output) -> list[tuple]:
    """Output items as comparable tuples (ids left out: they are fresh per response)."""
    described = []
    for item in output:
        if item.type == "message":
            described.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "function_call":
            described.append(("function_call", item.name, json.loads(item.arguments)))
        else:
            described.append((item.type, item.content[0].text))
    return described


async def _streamed(client, **kwargs) -> tuple[list, list[str], object]:
    """(the completed response's items, the event types in order, the completed response)."""
    stream = await client.responses.create(model="tiny", stream=True, **kwargs)
    types, text, completed = [], "", None
    async for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert [event for event in types[:2]] == ["response.created", "response.in_progress"]
    messages = [item for item in _items(completed.output) if item[0] == "message"]
    assert text == "".join(message[1] for message in messages)
    return _items(completed.output), types, completed


@pytest.mark.timeout(180)
def test_responses_text_tools_and_json_whole_and_streamed():
    async def scenario():
        async with colocated_http(config=CONFIG) as (client, pod, _):
            whole = await client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                                  max_output_tokens=6, temperature=0)
            assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
            assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
            assert whole.output_text and _items(whole.output) == [("message", whole.output_text)]
            items, types, completed = await _streamed(client, input="Hello there", instructions="Be brief.",
                                                      max_output_tokens=6, temperature=0)
            assert items == _items(whole.output) and types[-1] == "response.incomplete"
            assert completed.usage.output_tokens == 6

            named = await client.responses.create(model="tiny", input="Weather?", tools=TOOLS, temperature=0,
                                                  tool_choice={"type": "function", "name": "get_weather"},
                                                  max_output_tokens=40)
            [(kind, name, arguments)] = _items(named.output)
            assert (kind, name) == ("function_call", "get_weather") and named.status == "completed"
            jsonschema.validate(arguments, UNIT)
            items, types, _ = await _streamed(client, input="Weather?", tools=TOOLS, temperature=0,
                                              tool_choice={"type": "function", "name": "get_weather"},
                                              max_output_tokens=40)
            assert items == _items(named.output) and "response.function_call_arguments.delta" in types

            required = await client.responses.create(model="tiny", input="Weather?", tools=TOOLS, temperature=0,
                                                     tool_choice="required", max_output_tokens=60)
            assert all(item[0] == "function_call" for item in _items(required.output))

            # The model thinks, then calls (steered), read by the reasoning and tool-call parsers.
            steered = ('<think>\nCheck.\n</think>\n'
                       '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>')
            auto = dict(input="Weather?", tools=TOOLS, max_output_tokens=80,
                        extra_body={"guided_regex": _regex_of(steered)})
            called = await client.responses.create(model="tiny", **auto)
            assert _items(called.output) == [("reasoning", "\nCheck.\n"),
                                             ("function_call", "get_weather", {"unit": "c"})]
            items, _, _ = await _streamed(client, **auto)
            assert items == _items(called.output)

            # The call and its output go back as input items, as an agent loop sends them.
            call = named.output[0]
            follow_up = await client.responses.create(model="tiny", tools=TOOLS, max_output_tokens=4, input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], tool_choice="none")
            assert follow_up.usage.input_tokens > named.usage.input_tokens

            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}
            shaped = await client.responses.create(model="tiny", input="ok?", max_output_tokens=30, text={
                "format": {"type": "json_schema", "name": "answer", "schema": schema}})
            jsonschema.validate(json.loads(shaped.output_text), schema)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_what_a_storeless_server_cannot_do_is_refused_by_name():
    async def scenario():
        async with colocated_http() as (client, pod, _):
            cases = [
                (dict(previous_response_id="resp_1"), "'previous_response_id'"),
                (dict(tools=[{"type": "web_search"}]), "only function tools"),
                (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                 "only text parts"),
                (dict(input=[{"type": "item_reference", "id": "x"}]), "'item_reference'"),
                (dict(tools=TOOLS), '"auto"'),  # no --tool-call-parser on this server
                (dict(text={"format": {"type": "yaml"}}), "text.format"),
            ]
            for kwargs, needle in cases:
                kwargs.setdefault("input", "hi")
                with pytest.raises(openai.BadRequestError) as info:
                    await client.responses.create(model="tiny", max_output_tokens=4, **kwargs)
                assert needle in info.value.body["message"], (kwargs, info.value.body)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_agent_sdk_model_settings_are_taken_and_change_nothing_for_an_input_that_fits():
    """The request the OpenAI Agents SDK sends for ModelSettings(reasoning=Reasoning(effort="low"),
    truncation="auto", prompt_cache_retention="24h") (pydantic-ai's openai_reasoning_effort and
    openai_truncation send the same fields): answered as vLLM answers it, with the same greedy output as
    without them, the settings echoed."""
    async def scenario():
        async with colocated_http() as (client, pod, _):
            plain = dict(model="tiny", input=[{"role": "user", "content": "Hello there"}], instructions="Be brief.",
                         include=[], max_output_tokens=6, temperature=0)
            settled = await client.responses.create(**plain, reasoning={"effort": "low"}, truncation="auto",
                                                    prompt_cache_retention="24h")
            assert (settled.reasoning.effort, settled.truncation) == ("low", "auto")
            assert _items(settled.output) == _items((await client.responses.create(**plain)).output)
            chat = await client.chat.completions.create(model="tiny", messages=plain["input"], max_tokens=2,
                                                        prompt_cache_retention="24h")
            assert chat.usage.completion_tokens == 2
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_output_text_logprobs_whole_and_streamed_match_chat():
    """The Agents SDK's ModelSettings(top_logprobs=2) sends include ["message.output_text.logprobs"] and
    top_logprobs 2 (vLLM answers them): the output text's tokens with their logprobs, as chat gives them."""
    async def scenario():
        async with colocated_http() as (client, pod, _):
            asked = dict(input="Hello there", max_output_tokens=5, temperature=0, top_logprobs=2,
                         include=["message.output_text.logprobs"])
            whole = await client.responses.create(model="tiny", **asked)
            chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                                        max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
            expected = [(entry.token, entry.logprob, [top.token for top in entry.top_logprobs])
                        for entry in chat.choices[0].logprobs.content]
            [part] = whole.output[0].content
            assert [(entry.token, entry.logprob, [top.token for top in entry.top_logprobs])
                    for entry in part.logprobs] == expected and len(expected) == 5
            streamed = []
            async for event in await client.responses.create(model="tiny", stream=True, **asked):
                if event.type == "response.output_text.delta":
                    streamed += [(entry.token, entry.logprob) for entry in event.logprobs]
            assert streamed == [(token, logprob) for token, logprob, _ in expected]
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def test_split_responses_match_the_colocated_server(split_cluster):
    """The router (--tool-call-parser hermes) answers the Responses API as the colocated server does."""
    requests = [dict(input="Hello there", max_output_tokens=6, temperature=0),
                dict(input="Weather?", tools=TOOLS, temperature=0, max_output_tokens=40,
                     tool_choice={"type": "function", "name": "get_weather"})]

    async def colocated():
        async with colocated_http(config=CONFIG) as (client, _, _url):
            return [_items((await client.responses.create(model="tiny", **kwargs)).output) for kwargs in requests]

    with openai.OpenAI(base_url=split_cluster.router.http_url, api_key="unused", max_retries=0) as client:
        split = [_items(client.responses.create(model="tiny", **kwargs).output) for kwargs in requests]
    assert split == asyncio.run(colocated())
    _wait_pods_idle(split_cluster)
