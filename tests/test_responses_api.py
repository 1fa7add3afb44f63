"""The Responses API's translation: a request into the chat request it asks for, a chat answer into output
items, and a chat stream into Responses events in OpenAI's order."""
from __future__ import annotations

import pytest

from shared.serving.pod.outcomes import InvalidRequest
from shared.serving.openai.responses_protocol import ResponseEvents, ResponseShell, chat_body, output_items

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def test_a_request_becomes_the_chat_request_it_asks_for():
    chat = chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.2, "seed": 3,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}, "store": True,
        "input": [{"role": "developer", "content": "Use tools."},
                  {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text",
                                                                                          "text": "in Oslo?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
    })
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather\nin Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert chat["tools"] == [{"type": "function",
                              "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["max_tokens"], chat["temperature"], chat["seed"], chat["parallel_tool_calls"]) == (20, 0.2, 3, False)
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert chat_body({"input": "hi", "stream": True})["stream_options"] == {"include_usage": True}


def test_what_agent_sdks_send_is_taken_as_vllm_takes_it():
    """The OpenAI Agents SDK and pydantic-ai send reasoning, truncation and prompt_cache_retention from their
    model settings (vLLM takes them): reasoning.effort is chat's reasoning_effort, truncation "auto" changes
    nothing for an input that fits, the cache retention is a hint; the Response echoes what was asked."""
    body = {"input": [{"role": "user", "content": "hi"}], "instructions": "Be brief.", "include": [],
            "max_output_tokens": 10, "reasoning": {"effort": "low"}, "truncation": "auto",
            "prompt_cache_retention": "24h", "tools": [TOOL]}
    chat = chat_body(body)
    assert chat["reasoning_effort"] == "low"
    assert not {"truncation", "prompt_cache_retention", "reasoning"} & set(chat)
    echoed = ResponseShell(body, "m").response("completed", [])
    assert (echoed["reasoning"], echoed["truncation"]) == ({"effort": "low"}, "auto")
    assert "reasoning_effort" not in chat_body({"input": "hi", "reasoning": {"effort": None, "summary": None}})
    chat_body({"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "medium"}})  # the default


def _logprob(token: str) -> dict:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": list(token.encode())}]}


def test_output_text_logprobs_as_the_agents_sdk_asks_for_them():
    """include ["message.output_text.logprobs"] with top_logprobs (ModelSettings(top_logprobs=2)) asks chat for
    logprobs; its entries come back on the output text, whole and with each streamed delta."""
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    assert {key: chat_body(body)[key] for key in ("logprobs", "top_logprobs")} == {"logprobs": True, "top_logprobs": 2}
    assert "logprobs" not in chat_body({"input": "hi", "include": [], "top_logprobs": 2})
    [text] = output_items({"role": "assistant", "content": "Hi"}, {"content": [_logprob("Hi")]})
    assert text["content"][0]["logprobs"] == [_logprob("Hi")]
    events = ResponseEvents(ResponseShell(body, "m"))
    stream = events.chunk({"delta": {"role": "assistant"}, "logprobs": {"content": [_logprob("")]}})
    stream += events.chunk({"delta": {"content": "Hel"}, "logprobs": {"content": [_logprob("Hel")]}})
    stream += events.chunk({"delta": {"content": "lo"}, "logprobs": {"content": [_logprob("lo")]}})
    stream += events.finished("stop", None)
    deltas = [event["logprobs"] for event in stream if event["type"] == "response.output_text.delta"]
    assert deltas == [[_logprob(""), _logprob("Hel")], [_logprob("lo")]]
    [done] = [event for event in stream if event["type"] == "response.output_text.done"]
    assert done["logprobs"] == [_logprob(""), _logprob("Hel"), _logprob("lo")]
    assert stream[-1]["response"]["output"][0]["content"][0]["logprobs"] == done["logprobs"]


@pytest.mark.parametrize("body, needle", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "'previous_response_id'"),
    ({"input": "hi", "background": True}, "'background'"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "only function tools"),
    ({"input": "hi", "reasoning": {"effort": "high", "summary": "auto"}}, "'reasoning.summary'"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort must be"),
    ({"input": "hi", "truncation": "middle"}, "truncation must be"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include takes only"),
    ({"input": "hi", "bogus": 1}, "unknown field 'bogus'"),
    ({"input": []}, "'input' must be"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "verbosity"),
])
def test_what_cannot_be_served_is_refused_by_name(body, needle):
    with pytest.raises(InvalidRequest, match=needle):
        chat_body(body)


def test_a_chat_answer_becomes_output_items():
    message = {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    kinds = [(item["type"], item.get("name")) for item in output_items(message)]
    assert kinds == [("reasoning", None), ("function_call", "f")]
    [text] = output_items({"role": "assistant", "content": "hi"})
    assert text["content"][0]["text"] == "hi" and text["status"] == "completed"


def test_a_chat_stream_becomes_responses_events_in_openais_order():
    events = ResponseEvents(ResponseShell({"input": "hi"}, "m"))
    stream = events.started()
    stream += events.chunk({"delta": {"role": "assistant", "reasoning": "think"}})
    stream += events.chunk({"delta": {"content": "Hel"}})
    stream += events.chunk({"delta": {"content": "lo"}})
    stream += events.chunk({"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}})
    stream += events.finished("tool_calls", {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    assert [event["type"] for event in stream] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.output_item.done",  # the reasoning, once it ends
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [event["sequence_number"] for event in stream] == list(range(1, len(stream) + 1))
    done = stream[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message", "function_call"]
    assert [event["output_index"] for event in stream if event["type"] == "response.output_item.done"] == [0, 1, 2]
    assert done["usage"]["output_tokens"] == 5 and done["status"] == "completed"
    cut = ResponseEvents(ResponseShell({"input": "hi"}, "m"))
    assert cut.finished("length", None)[-1]["type"] == "response.incomplete"
