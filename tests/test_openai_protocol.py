"""The HTTP front's pure parts: the OpenAI field -> SamplingParams table, refused fields, prompts as vLLM
takes them; the presets' tokenizers (exact vocabulary, every id decodes, incremental detokenization across
multi-byte characters) and chat templates rendered exactly as transformers renders them."""
from __future__ import annotations

import json

import pytest

from shared.engine.model.model_config import LARGE_PRESETS, PRESETS
from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.engine.request import (
    MAX_LOGPROBS,
    MAX_N,
    MODEL_DEFAULT_FIELDS,
    SamplingParams,
    StructuredOutputSpec,
    TokenLogprobs,
)
from shared.serving.openai import messages, objects, protocol as oai
from shared.serving.openai.chat import CHAT_FIELDS
from shared.serving.chat_template import ChatTemplate, ChatTemplateError
from shared.serving.pod.outcomes import InvalidRequest
from shared.serving.text import TextCodec

# Every preset ships a tokenizer but the large ones (token ids only).
TOKENIZER_PRESETS = sorted(set(PRESETS) - LARGE_PRESETS)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 日本語!"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again 🙂"}]


def test_sampling_fields_map_onto_sampling_params():
    params = oai.sampling_params_from_openai({
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,
        "stop_token_ids": [9, 11], "ignore_eos": True,
    })
    assert params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3,
                                    stop_token_ids=(9, 11), ignore_eos=True, unset={"repetition_penalty"})
    # Where the request is silent: the model's defaults (filled by the pod), else OpenAI's (completions'
    # max_tokens is 16 as if sent, as in vLLM); vLLM's top_k -1 is "off"; chat's newer max name.
    assert oai.sampling_params_from_openai({}) == SamplingParams(
        temperature=1.0, unset=MODEL_DEFAULT_FIELDS - {"max_tokens"})
    assert oai.sampling_params_from_openai({"top_k": -1, "max_completion_tokens": 5}).top_k == 0
    assert oai.sampling_params_from_openai({"max_completion_tokens": 5}).max_tokens == 5


def test_chat_without_max_tokens_leaves_it_to_the_model_with_the_rest_of_the_context_behind():
    # vLLM: chat's max_tokens is generation_config.json's max_new_tokens, else the rest of the context.
    silent = oai.sampling_params_from_openai({}, is_chat=True, default_max_tokens=200)
    assert "max_tokens" in silent.unset and silent.max_tokens == 200
    named = oai.sampling_params_from_openai({"max_tokens": 7}, is_chat=True, default_max_tokens=200)
    assert "max_tokens" not in named.unset and named.max_tokens == 7


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens must be an integer"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids"),
])
def test_bad_sampling_values_are_refused_with_the_field_named(body, needle):
    with pytest.raises(InvalidRequest, match=needle):
        oai.sampling_params_from_openai(body)


def test_sampling_options_map_onto_sampling_params():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    params = oai.sampling_params_from_openai({
        "stop": "\n", "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "min_tokens": 2, "logit_bias": {"17": 5}, "max_tokens": 9,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    })
    assert params == SamplingParams(
        temperature=1.0, max_tokens=9, stop=("\n",), presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, min_tokens=2, logit_bias={17: 5.0}, unset={"temperature", "top_p", "top_k", "min_p"},
        structured_output=StructuredOutputSpec(json_schema=json.dumps(schema)),
    )
    assert oai.sampling_params_from_openai({"response_format": {"type": "json_object"}}).structured_output == \
        StructuredOutputSpec(json_object=True)
    assert oai.sampling_params_from_openai({"response_format": {"type": "text"}}).structured_output is None
    assert oai.sampling_params_from_openai({"guided_regex": "a+"}).structured_output == StructuredOutputSpec(regex="a+")
    for body, needle in (({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"stop": [1]}, "stop must be"),
                         ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"presence_penalty": 3}, "presence_penalty")):
        with pytest.raises(InvalidRequest, match=needle):
            oai.sampling_params_from_openai(body)


def test_unsupported_and_unknown_fields_are_refused_but_neutral_values_pass():
    oai.check_fields({"prompt": "x", "n": 1, "stop": None, "presence_penalty": 0, "user": "me"}, ("prompt",))
    for body, needle in (({"best_of": 2}, "'best_of' is not supported"), ({"echo": True}, "'echo'"),
                         ({"frobnicate": 1}, "unknown field 'frobnicate'")):
        with pytest.raises(InvalidRequest, match=needle):
            oai.check_fields({"prompt": "x", **body}, ("prompt",))


def test_n_and_logprobs_map_onto_sampling_params_per_endpoint():
    assert oai.sampling_params_from_openai({"n": 3}).n == 3
    assert oai.sampling_params_from_openai({"logprobs": 2}).logprobs == 2
    assert oai.sampling_params_from_openai({"logprobs": 0}).logprobs == 0
    assert oai.sampling_params_from_openai({}).logprobs is None
    chat = lambda body: oai.sampling_params_from_openai(body, is_chat=True).logprobs  # noqa: E731
    assert chat({"logprobs": True, "top_logprobs": 5}) == 5
    assert chat({"logprobs": True}) == 0  # the chosen token's logprob only
    assert chat({"logprobs": False}) is None and chat({"logprobs": False, "top_logprobs": 0}) is None
    assert chat({}) is None
    # The engine's one limit on the number of logprobs bounds both endpoints' fields.
    for body, is_chat, needle in (
        ({"logprobs": MAX_LOGPROBS + 1}, False, f"logprobs must be in \\[0, {MAX_LOGPROBS}\\]"),
        ({"logprobs": -1}, False, "logprobs must be in"),
        ({"logprobs": True}, False, "logprobs must be an integer"),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, True, "top_logprobs must be in"),
        ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs must be in"),
        ({"top_logprobs": 2}, True, "top_logprobs needs logprobs: true"),
        ({"logprobs": 3}, True, "logprobs must be true or false"),
        ({"n": 0}, False, "n must be"),
        ({"n": MAX_N + 1}, False, "n must be"),
    ):
        with pytest.raises(InvalidRequest, match=needle):
            oai.sampling_params_from_openai(body, is_chat=is_chat)


def test_max_tokens_defaults():
    assert oai.sampling_params_from_openai({}).max_tokens == oai.COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert oai.sampling_params_from_openai({}, is_chat=True, default_max_tokens=300).max_tokens == 300
    assert oai.sampling_params_from_openai({"max_tokens": 5}, default_max_tokens=300).max_tokens == 5


def _token_texts(ids):
    return [{7: "ab", 8: "c", 9: "é", 10: "d"}[i] for i in ids]


def test_completion_logprobs_as_vllm_writes_them():
    entries = [TokenLogprobs(7, -0.5, ((7, -0.5), (8, -1.5))), TokenLogprobs(9, float("-inf"), ((10, -0.1),))]
    logprobs, offset = objects.completion_logprobs(entries, _token_texts, text_offset=3)
    assert logprobs == {
        "tokens": ["ab", "é"],
        "token_logprobs": [-0.5, objects.MIN_LOGPROB],
        # The chosen token first, then the most likely ones.
        "top_logprobs": [{"ab": -0.5, "c": -1.5}, {"é": objects.MIN_LOGPROB, "d": -0.1}],
        "text_offset": [3, 5],
    }
    assert offset == 6


def test_chat_logprobs_as_openai_writes_them():
    entries = [TokenLogprobs(9, -0.25, ((10, -0.1), (9, -0.25)))]
    assert objects.chat_logprobs(entries, _token_texts) == {"content": [{
        "token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "d", "logprob": -0.1, "bytes": [100]},
                         {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}],
    }]}


def test_prompts_as_openai_and_vllm_take_them():
    assert oai.completion_prompts({"prompt": "hi"}) == ["hi"]
    assert oai.completion_prompts({"prompt": [5, 6]}) == [[5, 6]]
    assert oai.completion_prompts({"prompt": ["hi"]}) == ["hi"]
    assert oai.completion_prompts({"prompt": [[5, 6]]}) == [[5, 6]]
    assert oai.completion_prompts({"prompt": ["a", [7], "b"]}) == ["a", [7], "b"]
    too_many = ["x"] * (oai.MAX_COMPLETIONS_PER_REQUEST // 2 + 1)
    for body, needle in (({}, "'prompt' is required"), ({"prompt": ""}, "empty"), ({"prompt": []}, "empty"),
                         ({"prompt": ["a", ""]}, r"prompt\[1\] text is empty"), ({"prompt": [1, True]}, "token ids"),
                         ({"prompt": ["a", [1, -1]]}, r"prompt\[1\] must be"),
                         ({"prompt": too_many, "n": 2}, "at most 1024 completions")):
        with pytest.raises(InvalidRequest, match=needle):
            oai.completion_prompts(body)


def test_stream_options():
    assert oai.stream_options_from_openai({}) == oai.StreamOptions(False, False, False)
    assert oai.stream_options_from_openai({"stream": True, "stream_options": {"include_usage": True}}) == \
        oai.StreamOptions(True, True, False)
    with pytest.raises(InvalidRequest, match="only allowed with stream"):
        oai.stream_options_from_openai({"stream_options": {"include_usage": True}})


def test_chat_messages_are_read_as_openai_defines_them():
    parts = [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]
    assert messages.chat_messages({"messages": [{"role": "user", "content": parts, "name": "ann"}]}) == [
        {"role": "user", "content": "a\nb\nc", "name": "ann"}]
    # An assistant turn of tool calls alone: its null content is "" (vLLM's and transformers' reading).
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    read = messages.chat_messages({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "42"}]}]})
    assert read == [{"role": "assistant", "content": "", "tool_calls": [
                        {**call, "function": {"name": "f", "arguments": {"x": 1}}}]},
                    {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert messages.chat_template_options({}) == messages.ChatTemplateOptions()
    assert messages.chat_template_options({"add_generation_prompt": False, "continue_final_message": True,
                                           "chat_template_kwargs": {"x": 1}}) == \
        messages.ChatTemplateOptions(False, True, {"x": 1})
    with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
        messages.chat_template_options({"chat_template_kwargs": [1]})


@pytest.mark.parametrize("chat, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": ["hi"]}, "messages[0]"),
])
def test_a_malformed_message_is_refused_naming_its_field(chat, param):
    with pytest.raises(InvalidRequest) as refused:
        messages.chat_messages(chat)
    assert refused.value.param == param and param in str(refused.value)


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    assert messages.chat_template_options({"reasoning_effort": "low"}).template_variables == {
        "enable_thinking": True, "reasoning_effort": "low"}
    assert messages.chat_template_options({"reasoning_effort": "none",
                                           "chat_template_kwargs": {"enable_thinking": True}}).template_variables == {
        "enable_thinking": True, "reasoning_effort": "none"}
    for bad in ("extreme", 3, ["low"]):
        with pytest.raises(InvalidRequest) as refused:
            messages.chat_template_options({"reasoning_effort": bad})
        assert refused.value.param == "reasoning_effort"


@pytest.mark.parametrize("body, param", [
    ({"user": 5}, "user"), ({"user": ["a"]}, "user"), ({"metadata": {"k": 1}}, "metadata"),
    ({"store": "yes"}, "store"), ({"service_tier": 1}, "service_tier"), ({"parallel_tool_calls": "no"},
                                                                           "parallel_tool_calls"),
])
def test_informational_fields_of_the_wrong_type_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequest) as refused:
        oai.check_fields(body, ())
    assert refused.value.param == param


def test_a_sampling_field_of_the_wrong_type_is_refused_naming_it():
    for body, param in (({"temperature": "hot"}, "temperature"), ({"max_tokens": [1]}, "max_tokens"),
                        ({"stop": 5}, "stop"), ({"temperature": 900.0}, "temperature"),
                        ({"response_format": {"type": "json_schema", "json_schema": [1]}}, "response_format")):
        with pytest.raises(InvalidRequest) as refused:
            oai.sampling_params_from_openai(body)
        assert refused.value.param == param, body


@pytest.mark.parametrize("preset", TOKENIZER_PRESETS)
def test_preset_tokenizer_has_the_exact_vocab_and_every_id_decodes(preset):
    codec = TextCodec.from_path(preset)
    assert codec.vocab_size == PRESETS[preset].vocab_size
    decoded = codec.tokenizer.decode_batch([[token_id] for token_id in range(codec.vocab_size)])
    assert len(decoded) == codec.vocab_size and all(isinstance(text, str) for text in decoded)
    eos = PRESETS[preset].eos_token_id
    assert codec.tokenizer.id_to_token(eos) == "</s>" and codec.tokenizer.id_to_token(1) == "<s>"


def test_incremental_detokenization_is_exact_across_multibyte_characters():
    codec = TextCodec.from_path("tiny")
    text = "Grüße aus 日本語, emoji 🙂🙃 and ascii."
    ids = codec.encode(text)
    stream = codec.stream()
    pieces = [stream.push([token_id]) for token_id in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)  # no half characters on the way


@pytest.mark.slow
@pytest.mark.parametrize("preset", TOKENIZER_PRESETS)
def test_chat_template_renders_exactly_as_transformers(preset):
    from transformers import PreTrainedTokenizerFast

    directory = preset_tokenizer_dir(preset)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    reference = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **{
        k: config[k] for k in ("bos_token", "eos_token", "pad_token", "chat_template")})
    codec = TextCodec.from_path(preset)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert codec.chat_template.render(MESSAGES) == expected
    assert codec.encode_chat(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_a_template_that_raises_is_a_clear_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(MESSAGES)


def test_one_structured_output_constraint_per_request():
    with pytest.raises(InvalidRequest, match="guided_json and guided_regex"):
        oai.sampling_params_from_openai({"guided_json": {"type": "object"}, "guided_regex": "a+"})
    with pytest.raises(InvalidRequest, match="response_format and guided_regex"):
        oai.sampling_params_from_openai({"response_format": {"type": "json_object"}, "guided_regex": "b+"})
    # A text response_format asks for no constraint.
    params = oai.sampling_params_from_openai({"response_format": {"type": "text"}, "guided_regex": "b+"})
    assert params.structured_output.regex == "b+"


def test_guided_choice_is_a_grammar_of_its_literals():
    params = oai.sampling_params_from_openai({"guided_choice": ["yes", 'no "way"']})
    assert params.structured_output.grammar == 'start: "yes" | "no \\"way\\""'
    with pytest.raises(InvalidRequest, match="guided_choice"):
        oai.sampling_params_from_openai({"guided_choice": []})


def test_structured_outputs_takes_vllms_current_form_of_each_constraint():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    cases = {"json": (schema, StructuredOutputSpec(json_schema=json.dumps(schema))),
             "regex": ("a+", StructuredOutputSpec(regex="a+")),
             "grammar": ('start: "x"', StructuredOutputSpec(grammar='start: "x"')),
             "choice": (["yes", "no"], StructuredOutputSpec(grammar='start: "yes" | "no"')),
             "json_object": (True, StructuredOutputSpec(json_object=True))}
    for key, (value, spec) in cases.items():
        body = {"structured_outputs": {key: value, "whitespace_pattern": None}}
        assert oai.sampling_params_from_openai(body).structured_output == spec
    for value, message in (({"regex": "a", "choice": ["b"]}, "exactly one"), ({}, "exactly one"),
                           ({"structural_tag": "{}"}, "'structured_outputs.structural_tag' is not supported"),
                           ({"choice": []}, "structured_outputs.choice"), ("a+", "must be an object")):
        with pytest.raises(InvalidRequest, match=message):
            oai.sampling_params_from_openai({"structured_outputs": value})
    with pytest.raises(InvalidRequest, match="response_format and structured_outputs"):
        oai.sampling_params_from_openai({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})


def test_null_means_unset_for_stream_and_known_openai_fields():
    assert not oai.stream_options_from_openai({"stream": None}).is_streaming
    oai.check_fields({"audio": None, "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "s"}, ())
    with pytest.raises(InvalidRequest, match="'audio' is not supported"):
        oai.check_fields({"audio": {"voice": "alloy"}}, ())
    oai.check_fields({"reasoning_effort": "high"}, CHAT_FIELDS)  # chat takes it, as vLLM does
    # OpenAI's prompt cache hint (the Agents SDK's ModelSettings sends it): changes nothing in the output.
    oai.check_fields({"prompt_cache_retention": "24h"}, CHAT_FIELDS)
    # verbosity: its default ("medium") asks for nothing, as OpenAI takes it for a model without the setting.
    oai.check_fields({"verbosity": "medium"}, CHAT_FIELDS)
    with pytest.raises(InvalidRequest, match="'verbosity' is not supported"):
        oai.check_fields({"verbosity": "low"}, CHAT_FIELDS)
    with pytest.raises(InvalidRequest, match="prompt_cache_retention must be a string"):
        oai.check_fields({"prompt_cache_retention": 24}, CHAT_FIELDS)


def test_logit_bias_names_what_is_wrong():
    with pytest.raises(InvalidRequest, match="keys must be token ids"):
        oai.sampling_params_from_openai({"logit_bias": {"x": 1}})
    with pytest.raises(InvalidRequest, match=r"logit_bias\[5\] must be a finite number"):
        oai.sampling_params_from_openai({"logit_bias": {"5": "x"}})


def test_a_retry_hint_becomes_http_retry_after_in_whole_seconds():
    from shared.serving.generation import CallEnded
    from shared.serving.openai.errors import ended_error as _ended_error
    from shared.serving.pod.outcomes import RETRY_AFTER_KEY
    import grpc

    answer = _ended_error(CallEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", ((RETRY_AFTER_KEY, "1500"),)))
    assert answer.status_code == 429 and answer.headers["retry-after"] == "2"
    assert answer.headers["retry-after-ms"] == "1500"
    assert "retry-after" not in _ended_error(CallEnded(grpc.StatusCode.UNAVAILABLE, "down")).headers


def test_vllms_extra_fields_pass_at_their_defaults_and_are_refused_by_name_otherwise():
    oai.check_fields({"skip_special_tokens": True, "priority": 0, "documents": None, "kv_transfer_params": None,
                      "return_tokens_as_token_ids": False, "cache_salt": None}, ())
    for field, value in (("skip_special_tokens", False), ("priority", 5), ("truncate_prompt_tokens", 10),
                         ("cache_salt", "tenant-a"), ("chat_template", "{{ x }}")):
        with pytest.raises(InvalidRequest, match=f"'{field}' is not supported"):
            oai.check_fields({field: value}, ())
