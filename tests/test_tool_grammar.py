"""The grammar "auto" tool choice generates under, compiled by the engine's grammar compiler against the tiny
preset's tokenizer: what texts it lets a model write (free text, or calls in the parser's format whose
arguments follow their tool's schema, undeclared keys refused unless the schema allows them)."""
from __future__ import annotations

import pytest

from shared.engine.grammar import GrammarCompiler
from shared.serving.openai.tool_calls import ToolCallParser, tool_request
from shared.serving.text import TextCodec

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # silent on extras
OPEN = {"type": "object", "properties": {"tag": {"type": "string"}}, "additionalProperties": True}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": parameters}}
         for name, parameters in (("get_weather", CITY), ("tag_it", OPEN))] + [
    {"type": "function", "function": {"name": "get_time"}}]  # no parameters: {}


@pytest.fixture(scope="module")
def codec():
    return TextCodec.from_path("tiny")


@pytest.fixture(scope="module")
def compiler(codec):
    tokenizer = codec.tokenizer
    return GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [tokenizer.token_to_id("</s>")])


def allows(compiler, codec, text: str, parser=ToolCallParser.HERMES, opens_thinking=None, **body) -> bool:
    """Whether the whole text, then the end of sequence, is an output the "auto" grammar allows."""
    spec = tool_request({"tools": TOOLS, **body}, parser).auto_constraint(opens_thinking)
    grammar = compiler.compile(spec)
    tokens = codec.encode(text) + [codec.tokenizer.token_to_id("</s>")]
    return grammar.accept_tokens("r", tokens)


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama(name: str, parameters: str) -> str:
    return f'{{"name": "{name}", "parameters": {parameters}}}'


def test_hermes_allows_text_or_calls_whose_arguments_follow_their_schema(compiler, codec):
    ok = ["", "It is sunny in Oslo.", "Let me check.\n" + hermes("get_weather", '{"city": "Oslo"}'),
          hermes("get_weather", '{"city": "Oslo"}') + "\n" + hermes("get_time", "{}"),
          hermes("tag_it", '{"tag": "a", "more": [1, 2]}')]  # the schema allows undeclared keys
    refused = [hermes("get_weather", '{"city": "Oslo", "country": "Norway"}'),  # undeclared key
               hermes("get_weather", "{}"),  # a required key missing
               hermes("get_time", '{"utc": true}'),  # a tool without parameters takes none
               hermes("delete_all", "{}"),  # no such tool
               "Text <tool_call> then no call", hermes("get_time", "{}") + " and text after"]
    for text in ok:
        assert allows(compiler, codec, text), text
    for text in refused:
        assert not allows(compiler, codec, text), text


def test_parallel_tool_calls_false_allows_one_call(compiler, codec):
    two = hermes("get_time", "{}") + "\n" + hermes("get_time", "{}")
    assert allows(compiler, codec, two)
    assert not allows(compiler, codec, two, parallel_tool_calls=False)
    assert allows(compiler, codec, hermes("get_time", "{}"), parallel_tool_calls=False)
    joined = llama("get_time", "{}") + "; " + llama("get_time", "{}")
    assert allows(compiler, codec, joined, ToolCallParser.LLAMA3_JSON)
    assert not allows(compiler, codec, joined, ToolCallParser.LLAMA3_JSON, parallel_tool_calls=False)


def test_llama3_json_allows_text_not_starting_with_a_brace_or_calls(compiler, codec):
    ok = ["", "Sunny.", "Sunny {not a call}", llama("get_weather", '{"city": "Oslo"}'),
          " " + llama("get_weather", '{"city": "Oslo"}') + "; " + llama("get_time", "{}")]
    refused = [llama("get_weather", '{"city": "Oslo", "country": "Norway"}'), '{"city": "Oslo"}',
               llama("get_weather", '{"city": "Oslo"}') + " text after"]
    for text in ok:
        assert allows(compiler, codec, text, ToolCallParser.LLAMA3_JSON), text
    for text in refused:
        assert not allows(compiler, codec, text, ToolCallParser.LLAMA3_JSON), text


def test_thinking_comes_first_and_a_call_it_mentions_is_not_a_call(compiler, codec):
    call = hermes("get_weather", '{"city": "Oslo"}')
    extra = hermes("get_weather", '{"city": "Oslo", "country": "Norway"}')
    # The template opened the thinking: the output starts inside it and must close it.
    assert allows(compiler, codec, "Maybe <tool_call> get_weather.</think>\n\n" + call, opens_thinking=True)
    assert not allows(compiler, codec, "x</think>\n\n" + extra, opens_thinking=True)
    assert not allows(compiler, codec, "never closed", opens_thinking=True)
    # The model may think or not.
    for text in ["<think>Use <tool_call> here?</think>\n\nSunny.", "<think>ok</think>\n" + call, call, "Sunny."]:
        assert allows(compiler, codec, text, opens_thinking=False), text
    assert not allows(compiler, codec, "<think>ok</think>\n" + extra, opens_thinking=False)
    assert allows(compiler, codec, "<think>ok</think>\n" + llama("get_time", "{}"), ToolCallParser.LLAMA3_JSON,
                  opens_thinking=False)


def test_only_auto_has_the_grammar_and_a_requests_own_constraint_replaces_it():
    from shared.serving.openai.protocol import sampling_params_from_openai

    for choice in ("none", "required", {"type": "function", "function": {"name": "get_time"}}):
        assert tool_request({"tools": TOOLS, "tool_choice": choice}, ToolCallParser.HERMES).auto_constraint(None) is None
    auto = tool_request({"tools": TOOLS}, ToolCallParser.HERMES).auto_constraint(None)
    assert sampling_params_from_openai({}, is_chat=True, default_constraint=auto).structured_output == auto
    own = sampling_params_from_openai({"guided_regex": "Checking"}, is_chat=True, default_constraint=auto)
    assert own.structured_output.regex == "Checking"
    text = sampling_params_from_openai({"response_format": {"type": "text"}}, is_chat=True, default_constraint=auto)
    assert text.structured_output == auto
