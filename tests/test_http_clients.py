"""What clients send, as the official openai client and langchain-openai send it: tool loops whose assistant turn
has "content": null (chat, the Responses API, LangChain), schemas silent on additionalProperties, errors as
clients parse them, and malformed requests refused naming the field; colocated (in process) and split (the
router's own front and length check, the pods' grammars)."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest

from shared.serving.openai.config import HttpConfig
from shared.serving.openai.tool_calls import ToolCallParser
from shared.serving.text import TextCodec
from tests.test_http_api import MAX_MODEL_LEN, _all_free, _wait_pods_idle, _wait_until, colocated_http

pytestmark = pytest.mark.e2e

# Silent on additionalProperties: the model may add no other key (vLLM's default backend).
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": CITY}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = {"role": "user", "content": "Weather in Paris?"}
HERMES = HttpConfig(tool_call_parser=ToolCallParser.HERMES)


def _split_client(split_cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused", max_retries=0)


# ---- tool loops --------------------------------------------------------------------------------


async def _chat_tool_round_trip(client: openai.AsyncOpenAI, url: str) -> None:
    """A forced call, its result sent back beside the assistant's "content": null turn (OpenAI's shape)."""
    first = await client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER],
                                                 tool_choice=FORCED, max_tokens=30, temperature=0)
    [call] = first.choices[0].message.tool_calls
    assert json.loads(call.function.arguments).keys() == {"city"}
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "name": "get_weather",
                 "content": [{"type": "text", "text": "sunny"}]}]
    second = await client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                  tool_choice="none", max_tokens=4, temperature=0)
    assert second.choices[0].message.role == "assistant" and second.usage.completion_tokens >= 1
    # The template saw the null content as "" and the tool's parts as their text (transformers' rendering).
    async with httpx.AsyncClient(timeout=30) as http:
        tokens = (await http.post(f"{url.removesuffix('/v1')}/tokenize", json={"messages": messages})).json()
    rendered = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [
                    {**call.model_dump(), "function": {"name": "get_weather",
                                                       "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": call.id, "name": "get_weather"}]
    assert tokens["tokens"] == TextCodec.from_path("tiny").encode_chat(rendered)


@pytest.mark.timeout(120)
def test_colocated_chat_tool_round_trip_with_null_content():
    async def scenario():
        async with colocated_http() as (client, pod, url):
            await _chat_tool_round_trip(client, f"{url}/v1")
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def test_split_chat_tool_round_trip_with_null_content(split_cluster):
    async def scenario():
        async with _split_client(split_cluster) as client:
            await _chat_tool_round_trip(client, split_cluster.router.http_url)

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


@pytest.mark.timeout(120)
def test_responses_api_tool_round_trip():
    """A function_call output item sent back with its function_call_output: the chat turn built from it has
    a null content, which renders as ""."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}

    async def scenario():
        async with colocated_http() as (client, pod, _):
            first = await client.responses.create(model="tiny", input="Weather in Paris?", tools=[tool],
                                                  tool_choice={"type": "function", "name": "get_weather"},
                                                  max_output_tokens=30, temperature=0)
            [call] = [item for item in first.output if item.type == "function_call"]
            assert json.loads(call.arguments).keys() == {"city"}
            second = await client.responses.create(model="tiny", tools=[tool], max_output_tokens=4, temperature=0,
                                                   tool_choice="none", input=[
                                                       {"role": "user", "content": "Weather in Paris?"},
                                                       call.model_dump(exclude_none=True),
                                                       {"type": "function_call_output", "call_id": call.call_id,
                                                        "output": "sunny"}])
            # Served: a message (cut at max_output_tokens, the random weights' answer is "incomplete").
            assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
            assert second.usage.output_tokens >= 1
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_langchain_tool_loop():
    """langchain-openai as an agent loop drives it: a forced call, the tool run, its result sent back (LangChain
    sends the assistant's turn with "content": null), and the model's next turn with the tools bound ("auto")."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def scenario():
        async with colocated_http(config=HERMES) as (_, pod, url):
            llm = ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=30,
                             max_retries=0)
            messages = [HumanMessage("Weather in Paris?")]
            called = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke(messages)
            [call] = called.tool_calls
            assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
            messages += [called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
            answer = await llm.bind_tools([get_weather]).ainvoke(messages)
            assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


# ---- schemas silent on additionalProperties -----------------------------------------------------


async def _only_declared_keys(client: openai.AsyncOpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    answer = await client.chat.completions.create(model="tiny", messages=[QUESTION], response_format=response_format,
                                                  max_tokens=30, temperature=0)
    assert json.loads(answer.choices[0].message.content).keys() == {"city"}
    required = await client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER],
                                                    tool_choice="required", max_tokens=40, temperature=0)
    calls = required.choices[0].message.tool_calls
    assert calls and all(json.loads(call.function.arguments).keys() == {"city"} for call in calls)


@pytest.mark.timeout(120)
def test_colocated_schemas_silent_on_additional_properties_take_only_declared_keys():
    async def scenario():
        async with colocated_http() as (client, pod, _):
            await _only_declared_keys(client)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def test_split_schemas_silent_on_additional_properties_take_only_declared_keys(split_cluster):
    async def scenario():
        async with _split_client(split_cluster) as client:
            await _only_declared_keys(client)

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


# ---- errors as clients parse them ----------------------------------------------------------------


async def _errors_as_clients_parse_them(client: openai.AsyncOpenAI, url: str, max_model_len: int) -> None:
    with pytest.raises(openai.BadRequestError) as overflow:
        await client.completions.create(model="tiny", prompt=[5] * (max_model_len - 2), max_tokens=10)
    assert overflow.value.body["message"].startswith(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{max_model_len + 8} tokens ({max_model_len - 2} in the messages, 10 in the completion).")
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.chat.completions.create(model="gpt-9", messages=[QUESTION], max_tokens=2)
    assert (unknown.value.body["code"], unknown.value.body["param"]) == ("model_not_found", "model")
    assert "gpt-9" in unknown.value.body["message"]
    effort = await client.chat.completions.create(model="tiny", messages=[QUESTION], max_tokens=2,
                                                  reasoning_effort="low")
    assert effort.choices[0].message.role == "assistant"
    async with httpx.AsyncClient(timeout=30) as http:
        for model in (["tiny"], {"name": "tiny"}, 7):
            answer = await http.post(f"{url}/chat/completions", json={"model": model, "messages": [QUESTION]})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "model", answer.text


@pytest.mark.timeout(120)
def test_colocated_errors_as_clients_parse_them():
    async def scenario():
        async with colocated_http() as (client, pod, url):
            await _errors_as_clients_parse_them(client, f"{url}/v1", MAX_MODEL_LEN)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())


def test_split_errors_as_clients_parse_them(split_cluster):
    async def scenario():
        async with _split_client(split_cluster) as client:
            await _errors_as_clients_parse_them(client, split_cluster.router.http_url, 2048)

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


# ---- malformed requests: 400 naming the field -----------------------------------------------------

MALFORMED = [
    (dict(messages=[QUESTION], user=5), "user"),
    (dict(messages=[QUESTION], user={"id": 1}), "user"),
    (dict(messages=[{"role": "system"}, QUESTION]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (dict(messages=[{"role": "tool", "tool_call_id": "c"}, QUESTION]), "messages[0].content"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages[0].content[0].text"),
]


@pytest.mark.timeout(120)
def test_malformed_chat_requests_get_400_naming_the_field():
    """The fuzz run's categories (a non-string user, a non-assistant message without content, an unknown role, a
    text part without text): each a 400 with OpenAI's error object naming the field, and nothing run."""
    async def scenario():
        async with colocated_http() as (client, pod, _):
            for fields, param in MALFORMED:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model="tiny", max_tokens=2, **fields)
                assert refused.value.body["param"] == param, (fields, refused.value.body)
                assert refused.value.body["type"] == "invalid_request_error"
                assert pod.loop.num_in_flight == 0

    asyncio.run(scenario())
