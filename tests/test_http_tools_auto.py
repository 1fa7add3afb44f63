"""Tool choice "auto" over HTTP with a real model (SmolLM2-135M-Instruct, the `smollm2-135m` preset, in
float32), through the official `openai` client: shown calls that pass an undeclared key, the model writes
one too; under "auto"'s grammar its call carries only the keys its tool's schema declares, and text is still
text. The tiny preset cannot show it: its random weights never write a call of their own."""
from __future__ import annotations

import asyncio
import json

import pytest

from shared.engine.model.fetched_presets import fetch_preset
from shared.serving.openai.config import HttpConfig
from shared.serving.openai.tool_calls import ToolCallParser
from tests.test_http_api import _all_free, _wait_until, colocated_http
from tests.test_http_tools import _streamed_calls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Silent on additionalProperties: undeclared keys are refused (vLLM's default backend reads it so).
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}}]


def _shown_call(city: str, country: str) -> dict:
    """An earlier turn's call, as text in the model's format, passing a key the tool does not declare."""
    call = {"name": "get_weather", "arguments": {"city": city, "country": country}}
    return {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"}


MESSAGES = [{"role": "system", "content": "You call tools."}]
for _city, _country in (("Paris", "France"), ("Rome", "Italy"), ("Berlin", "Germany")):
    MESSAGES += [{"role": "user", "content": f"Weather in {_city}?"}, _shown_call(_city, _country)]
MESSAGES.append({"role": "user", "content": "Weather in Oslo?"})


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return str(fetch_preset("smollm2-135m"))
    except ValueError as exc:  # offline: the preset's own one-line instructions
        pytest.skip(str(exc))


def test_auto_tool_calls_carry_only_declared_keys(smollm2):
    async def scenario():
        async with colocated_http(model=smollm2, dtype="float32",
                                  config=HttpConfig(tool_call_parser=ToolCallParser.HERMES)) as (client, pod, _):
            ask = dict(model=smollm2, tools=TOOLS, temperature=0, max_tokens=40)
            answer = await client.chat.completions.create(messages=MESSAGES, **ask)
            calls = [(call.function.name, json.loads(call.function.arguments))
                     for call in answer.choices[0].message.tool_calls or []]
            assert calls == [("get_weather", {"city": "Oslo"})], answer.choices[0].message
            assert answer.choices[0].finish_reason == "tool_calls"
            stream = await client.chat.completions.create(messages=MESSAGES, stream=True, **ask)
            assert _streamed_calls([chunk async for chunk in stream]) == ("", calls)
            # With nothing to call for, the model's text is its answer, untouched.
            plain = await client.chat.completions.create(messages=[{"role": "user", "content": "Say hi."}], **ask)
            assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content.strip()
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())
