"""A reasoning model's thinking over HTTP (--reasoning-parser), through the official `openai` client on the
colocated server: `reasoning` (and `reasoning_content`) apart from `content`, whole and streamed, opened by
the model or by the prompt, and tool calls read from the answer after it. The tiny preset has random
weights, so guided_regex makes it write a thinking model's output."""
from __future__ import annotations

import asyncio
import json

import pytest

from shared.serving.openai.config import HttpConfig
from shared.serving.openai.reasoning import ReasoningParser
from shared.serving.openai.tool_calls import ToolCallParser
from tests.test_http_api import _all_free, _wait_until, colocated_http
from tests.test_http_tools import _regex_of

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Which is larger, 9.11 or 9.8?"}]
THOUGHT = "<think>\nCompare the tenths.\n</think>\n\n9.8 is larger."
TOOL_CALL = ('<think>\nI should look it up.\n</think>\n'
             '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]




async def _whole_and_streamed(client, **kwargs) -> tuple[dict, dict]:
    """(message fields of the whole answer, the same fields added up from the stream)."""
    whole = (await client.chat.completions.create(model="tiny", max_tokens=80, temperature=0, **kwargs)).choices[0]
    message = whole.message.model_dump()
    stream = await client.chat.completions.create(model="tiny", max_tokens=80, temperature=0, stream=True, **kwargs)
    streamed = {"reasoning": "", "reasoning_content": "", "content": "", "tool_calls": []}
    async for chunk in stream:
        delta = chunk.choices[0].delta.model_dump()
        for field in ("reasoning", "reasoning_content", "content"):
            streamed[field] += delta.get(field) or ""
        streamed["tool_calls"] += delta.get("tool_calls") or []
    return message, streamed


@pytest.mark.timeout(180)
def test_thinking_comes_apart_from_the_answer_whole_and_streamed():
    config = HttpConfig(reasoning_parser=ReasoningParser.QWEN3, tool_call_parser=ToolCallParser.HERMES)

    async def scenario():
        async with colocated_http(config=config) as (client, pod, _):
            message, streamed = await _whole_and_streamed(
                client, messages=MESSAGES, extra_body={"guided_regex": _regex_of(THOUGHT)})
            assert (message["reasoning"], message["content"]) == ("\nCompare the tenths.\n", "\n\n9.8 is larger.")
            assert message["reasoning_content"] == message["reasoning"]
            assert (streamed["reasoning"], streamed["content"]) == (message["reasoning"], message["content"])
            assert streamed["reasoning_content"] == streamed["reasoning"]

            # The prompt opens the thinking (as DeepSeek-R1's template does): the output starts inside it.
            opened = [*MESSAGES, {"role": "assistant", "content": "<think>"}]
            message, streamed = await _whole_and_streamed(
                client, messages=opened, extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                     "guided_regex": _regex_of("Tenths.</think>9.8")})
            assert (message["reasoning"], message["content"]) == ("Tenths.", "9.8")
            assert (streamed["reasoning"], streamed["content"]) == ("Tenths.", "9.8")

            # A tool call after the thinking is read from the answer.
            message, streamed = await _whole_and_streamed(
                client, messages=MESSAGES, tools=TOOLS, extra_body={"guided_regex": _regex_of(TOOL_CALL)})
            assert message["reasoning"] == "\nI should look it up.\n"
            [call] = message["tool_calls"]
            assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("lookup", {"q": "x"})
            assert streamed["reasoning"] == message["reasoning"] and len(streamed["tool_calls"]) == 1

            # A model that does not think answers plainly: no reasoning field.
            plain = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                                         extra_body={"guided_regex": "Hello"})
            assert plain.choices[0].message.content == "Hello"
            assert "reasoning" not in plain.choices[0].message.model_dump(exclude_none=True)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())
