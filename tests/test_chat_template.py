"""Chat templates are found where transformers' AutoTokenizer finds them (chat_template.jinja and
additional_chat_templates/ before tokenizer_config.json, named templates by "default", chat_template.json
when the tokenizer has none) and render to the text and tokens of its apply_chat_template, for templates in
the styles of Llama 3.1, Mistral, Qwen2.5 and ChatML and for every global, filter and tag transformers gives
templates; a content given as text parts is joined with newlines, as vLLM does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.serving.chat_template import ChatTemplate, ChatTemplateError
from shared.serving.text import TextCodec

transformers = pytest.importorskip("transformers")

LLAMA_31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """{%- set today = strftime_now("%Y-%m-%d") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant. Today is " + today + "." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}[SYSTEM_PROMPT]{{ system_message }}[/SYSTEM_PROMPT]
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

QWEN_25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# What transformers gives templates beyond plain jinja2: its tojson options, loop controls, the
# {% generation %} tag, dict and namespace, tools and documents as none, reasoning under its aliases,
# keys with None values dropped, and every special token of the config (a model-specific one too).
TRANSFORMERS_EXTRAS = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
    {%- if m.role == 'skip' %}{% continue %}{% endif -%}
    {%- if m.role == 'stop' %}{% break %}{% endif -%}
    {%- set ns.count = ns.count + 1 -%}
    {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif -%}
    {%- if m.name is defined %}({{ m.name }}){% endif -%}
    {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
{% endfor -%}
{{ dict(b="é<&>", a=[1, 2]) | tojson(indent=2, sort_keys=true) }}{{ {"x": 1, "y": "ü"} | tojson(separators=(",", ":")) }}
|{{ documents is none }}|{{ tools is none }}|{{ ns.count }}|{{ pad_token is defined }}|{{ unk_token is defined }}
|{{ image_token }}|{{ eos_token }}|{{ add_generation_prompt }}
"""

TEMPLATES = {"llama_3_1": LLAMA_31, "mistral": MISTRAL, "qwen_2_5": QWEN_25, "chatml": CHATML,
             "transformers_extras": TRANSFORMERS_EXTRAS}

CONVERSATION = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Grüße, 日本語!"},
                {"role": "assistant", "content": "Hi.", "name": None, "tool_calls": None},
                {"role": "user", "content": "Again 🙂 <tag> & \"quotes\""}]
TOOL_CALL = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich <x>"}}}]},
             {"role": "tool", "content": "sunny"}]
EXTRAS = [{"role": "user", "content": "a", "name": "ann"}, {"role": "skip", "content": "hidden"},
          {"role": "assistant", "content": "b", "reasoning": "because"}, {"role": "user", "content": "c"},
          {"role": "stop", "content": "x"}, {"role": "user", "content": "never"}]
CONVERSATIONS = {"llama_3_1": [CONVERSATION], "mistral": [CONVERSATION[1:]], "qwen_2_5": [CONVERSATION, TOOL_CALL],
                 "chatml": [CONVERSATION], "transformers_extras": [EXTRAS]}

TOKENIZER_CONFIG = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
                    "pad_token": None, "image_token": "<|user|>", "add_bos_token": True}


def tokenizer_dir(directory: Path, **config) -> Path:
    """The tiny preset's tokenizer.json with this tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(preset_tokenizer_dir("tiny") / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def reference(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_encodes_exactly_as_transformers(tmp_path, name, add_generation_prompt):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=TEMPLATES[name])
    expected_tokenizer, codec = reference(directory), TextCodec.from_path(str(directory))
    for messages in CONVERSATIONS[name]:
        expected = expected_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert codec.chat_template.render(messages, add_generation_prompt=add_generation_prompt) == expected
        assert codec.encode_chat(messages, add_generation_prompt=add_generation_prompt) == \
            expected_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   return_dict=False)


def test_template_variables_override_special_tokens_as_in_transformers(tmp_path):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=LLAMA_31)
    variables = {"date_string": "26 Jul 2024", "bos_token": "<B>", "tools": [{"name": "t"}]}
    messages = CONVERSATION[1:2]
    expected = reference(directory).apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                        **variables)
    assert "Environment: ipython" in expected and "26 Jul 2024" in expected
    assert TextCodec.from_path(str(directory)).chat_template.render(messages, variables=variables) == expected


@pytest.mark.parametrize("template", ["LLAMA_31", "CHATML"])
def test_continue_final_message_ends_inside_the_last_message_as_in_transformers(tmp_path, template):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=globals()[template])
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    expected = reference(directory).apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                        continue_final_message=True)
    assert expected.endswith("The colour is")
    template = TextCodec.from_path(str(directory)).chat_template
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == expected
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template.render(messages, continue_final_message=True)


def test_template_variables_may_set_add_generation_prompt_but_not_the_messages(tmp_path):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=LLAMA_31)
    template = TextCodec.from_path(str(directory)).chat_template
    messages = CONVERSATION[1:2]
    assert template.render(messages, variables={"add_generation_prompt": False, "self": 1}) == \
        template.render(messages, add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="may not set messages"):
        template.render(messages, variables={"messages": []})


def test_strftime_now_dates_the_prompt():
    from datetime import datetime

    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}", {})
    assert template.render([{"role": "user", "content": "hi"}]) == datetime.now().strftime("%Y-%m-%d")


def test_a_template_that_refuses_the_messages_is_a_chat_template_error(tmp_path):
    codec = TextCodec.from_path(str(tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=MISTRAL)))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        codec.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="failed on these messages"):  # a Python error inside the template
        ChatTemplate("{{ messages[0]['content'] + 1 }}", {}).render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", {}).render([])


# ---- where the template comes from -------------------------------------------------------------


def saved_by_transformers(directory: Path, chat_template) -> Path:
    """A tokenizer as transformers >= 4.4x saves it: templates in chat_template.jinja and
    additional_chat_templates/, none in tokenizer_config.json."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(preset_tokenizer_dir("tiny") / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return directory


def rendered(directory: Path) -> str | None:
    template = TextCodec.from_path(str(directory)).chat_template
    return None if template is None else template.render(CONVERSATION)


def test_chat_template_jinja_saved_by_transformers_is_used(tmp_path):
    directory = saved_by_transformers(tmp_path, CHATML)
    assert (directory / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    assert rendered(directory) == reference(directory).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_named_templates_saved_by_transformers_use_the_default(tmp_path):
    directory = saved_by_transformers(tmp_path, {"default": CHATML, "tool_use": QWEN_25, "rag": LLAMA_31})
    assert (directory / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert rendered(directory) == reference(directory).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


TOOLS = [{"type": "function", "function": {"name": "get", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("named", [False, True])
def test_tools_are_rendered_as_transformers_renders_them(tmp_path, named):
    """With tools, transformers renders the tool_use template where the checkpoint names one."""
    directory = saved_by_transformers(tmp_path, {"default": CHATML, "tool_use": QWEN_25} if named else QWEN_25)
    template = TextCodec.from_path(str(directory)).chat_template
    for messages in (CONVERSATION, TOOL_CALL):
        expected = reference(directory).apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                            add_generation_prompt=True)
        assert "<tools>" in expected and template.render(messages, tools=TOOLS) == expected
    assert template.render(CONVERSATION) == reference(directory).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("form", ["list", "dict"])
def test_named_templates_in_tokenizer_config_use_the_default(tmp_path, form):
    named = {"tool_use": QWEN_25, "default": CHATML}
    value = [{"name": name, "template": source} for name, source in named.items()] if form == "list" else named
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=value)
    assert rendered(directory) == reference(directory).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=LLAMA_31)
    (directory / "chat_template.jinja").write_text(CHATML)
    expected = reference(directory).apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<|im_start|>system") and rendered(directory) == expected


def test_template_files_replace_every_template_of_tokenizer_config(tmp_path):
    """Named files without a default hide the config's template in transformers too: no template."""
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=CHATML)
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text(QWEN_25)
    with pytest.raises(ValueError, match="no default"):
        reference(directory).apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered(directory) is None


def test_legacy_chat_template_json_is_used_when_the_tokenizer_has_none(tmp_path):
    directory = tokenizer_dir(tmp_path, **TOKENIZER_CONFIG)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    expected = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json")) \
        .apply_chat_template(CONVERSATION, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    assert rendered(directory) == expected
    (directory / "chat_template.jinja").write_text(LLAMA_31)  # the tokenizer's own template comes first
    assert rendered(directory).startswith("<s><|start_header_id|>system")


def test_special_tokens_of_special_tokens_map_json_in_older_checkpoints(tmp_path):
    """A tokenizer_config.json without added_tokens_decoder predates it: special_tokens_map.json names the tokens."""
    template = "{{ bos_token }}|{{ pad_token }}|{{ eos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    directory = tokenizer_dir(tmp_path, bos_token="<s>", eos_token="</s>", chat_template=template)
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<B>", "lstrip": False, "rstrip": False}, "pad_token": "<pad>"}))
    expected = reference(directory).apply_chat_template(CONVERSATION, tokenize=False)
    assert expected.startswith("<B>|<pad>|</s>") and rendered(directory) == expected


def test_no_template_is_a_chat_template_error_naming_where_to_put_one(tmp_path):
    codec = TextCodec.from_path(str(tokenizer_dir(tmp_path, **TOKENIZER_CONFIG)))
    assert codec.chat_template is None
    with pytest.raises(ChatTemplateError, match="chat_template.jinja"):
        codec.encode_chat(CONVERSATION)


# ---- content given as parts (vLLM's "string" content format) ------------------------------------


def test_text_parts_are_joined_with_newlines_as_vllm_does(tmp_path):
    codec = TextCodec.from_path(str(tokenizer_dir(tmp_path, **TOKENIZER_CONFIG, chat_template=CHATML)))
    parts = [{"type": "text", "text": "Hello"}, "plain", {"type": "text", "text": None},
             {"type": "input_text", "text": "world"}]
    joined = [{"role": "user", "content": "Hello\nplain\nworld"}]
    assert codec.encode_chat([{"role": "user", "content": parts}]) == codec.encode_chat(joined)
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].content: only text parts"):
        codec.encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_tokenizer_json_path_finds_the_template_beside_it(tmp_path):
    directory = saved_by_transformers(tmp_path, CHATML)
    codec = TextCodec.from_path(str(directory / "tokenizer.json"))
    assert codec.chat_template.render(CONVERSATION) == rendered(directory)
