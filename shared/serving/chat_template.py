"""Chat templates of a checkpoint's tokenizer, found where transformers' AutoTokenizer finds them and rendered
the way its apply_chat_template renders them: the same sandbox, globals, filters, extensions and variables,
so a template transformers renders renders here to the same text."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from shared.engine.model.checkpoint_json import read_json_object

logger = logging.getLogger(__name__)

# Where a checkpoint keeps its templates (transformers' names). Files win over tokenizer_config.json's
# "chat_template"; chat_template.json is the processors' legacy file, read only when the tokenizer has none.
TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
LEGACY_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
DEFAULT_NAME = "default"  # the named template transformers uses when no tools are passed
TOOL_USE_NAME = "tool_use"  # the one it uses when tools are passed, where a checkpoint has it

# Names a message's reasoning comes under; transformers fills the first (and "thinking") from any of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The messages cannot become a prompt: no chat template, or the template refused them (its
    raise_exception) or failed on them."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], tool_use_source: str | None = None):
        self._template = _parsed(source)
        self._tool_use_template = _parsed(tool_use_source) if tool_use_source else self._template
        self._special_tokens = special_tokens

    @classmethod
    def from_directory(cls, directory: str | Path) -> "ChatTemplate | None":
        """The default chat template of a tokenizer directory, None when it has none. ValueError when a file
        is unreadable or the template does not parse."""
        directory = Path(directory)
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        templates = _template_files(directory) or _named_templates(config.get("chat_template"))
        if not templates:
            templates = _named_templates(_read_json(directory / LEGACY_TEMPLATE_FILE).get("chat_template"))
        return cls._default_of(templates, _special_tokens(config, directory))

    @classmethod
    def _default_of(cls, templates: dict[str, str], special_tokens: dict[str, str]) -> "ChatTemplate | None":
        source = templates.get(DEFAULT_NAME)
        if templates and not isinstance(source, str):
            # transformers refuses to choose among named templates without a default; so do we.
            logger.warning("the tokenizer's chat templates %s include no %r one: chat is off",
                           sorted(templates), DEFAULT_NAME)
        if not isinstance(source, str) or not source:
            return None
        tool_use = templates.get(TOOL_USE_NAME)
        return cls(source, special_tokens, tool_use if isinstance(tool_use, str) else None)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: Mapping[str, Any] | None = None,
               tools: list[dict] | None = None) -> str:
        """The prompt text; variables (vLLM's chat_template_kwargs) override the special tokens, as in
        transformers, and add_generation_prompt, as in vLLM; never the messages. continue_final_message:
        the text ends inside the last message (its content continues), as transformers cuts it. tools: the
        functions the model may call (OpenAI's tool objects; else any the variables give), rendered by the
        checkpoint's tool_use template where it has one, as in transformers."""
        variables = dict(variables or {})
        if "messages" in variables:
            raise ChatTemplateError("chat_template_kwargs may not set messages")
        context = {"tools": None, "documents": None, **self._special_tokens,
                   "add_generation_prompt": add_generation_prompt, **variables}
        context["messages"] = [_template_message(message) for message in messages]
        if tools is not None:
            context["tools"] = tools
        template = self._template if context["tools"] is None else self._tool_use_template
        if not continue_final_message:
            return self._render(template, context)
        if context["add_generation_prompt"]:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        final = context["messages"][-1] if context["messages"] else {}
        if not isinstance(final.get("content"), str) or not final["content"]:
            raise ChatTemplateError("continue_final_message needs a last message with text content to continue")
        context["messages"][-1] = {**final, "content": final["content"] + _CONTINUE_TAG}
        return _cut_at_continue_tag(self._render(template, context), final["content"])

    @staticmethod
    def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
        try:
            return template.render(context)  # a dict: any key, "self" included, is a template variable
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - checkpoint code run on client input: any failure refuses the input
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


def _parsed(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template does not parse: {exc}") from None


# transformers' marker after the content to continue: the rendered text is cut where it shows.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_continue_tag(rendered: str, final_content: str) -> str:
    """The text up to the end of the last message's content (transformers' rule, spacing included)."""
    tag = _CONTINUE_TAG.strip()
    if final_content.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template does not keep the last message's "
                                "content, so there is nothing to continue")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the spacing after the content


# ---- loading ----------------------------------------------------------------------------------


def _read_json(file: Path) -> dict:
    """The file's JSON object, {} when there is no such file."""
    return read_json_object(file) if file.is_file() else {}


def _template_files(directory: Path) -> dict[str, str]:
    """chat_template.jinja (the default) and additional_chat_templates/<name>.jinja, as transformers saves
    them; together they replace any template in tokenizer_config.json."""
    named = sorted((directory / NAMED_TEMPLATE_DIR).glob("*.jinja"))
    files = {path.name.removesuffix(".jinja"): path for path in named}
    if (directory / TEMPLATE_FILE).is_file():
        files[DEFAULT_NAME] = directory / TEMPLATE_FILE
    try:
        return {name: path.read_text(encoding="utf-8") for name, path in files.items()}
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read a chat template: {exc}") from None


def _named_templates(value: Any) -> dict[str, str]:
    """A "chat_template" entry by name: one string is the default; a list holds {"name", "template"}."""
    if isinstance(value, str):
        return {DEFAULT_NAME: value}
    if isinstance(value, list):
        return {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
    if isinstance(value, dict):
        return dict(value)
    return {}


def _special_tokens(config: dict, directory: Path | None = None) -> dict[str, str]:
    """The variables transformers' special_tokens_map gives every template: each *_token of the config
    (model-specific ones such as image_token too) and of its extra_special_tokens mapping. A config without
    added_tokens_decoder is from before tokenizer_config.json held them: special_tokens_map.json overrides it."""
    values = dict(config)
    if directory is not None and "added_tokens_decoder" not in config:
        values.update(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
    if isinstance(values.get("extra_special_tokens"), dict):
        values.update(values["extra_special_tokens"])
    tokens = {name: _token_text(value) for name, value in values.items() if name.endswith("_token")}
    return {name: token for name, token in tokens.items() if token is not None}


def _token_text(value: Any) -> str | None:
    """A special token is a string or an AddedToken dict; anything else (null, a flag) is none."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value if isinstance(value, str) else None


# ---- rendering --------------------------------------------------------------------------------


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to templates: keys whose value is None dropped (templates test
    presence, not None), and its reasoning under every name templates read it by."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[field] for field in _REASONING_FIELDS if field in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' template environment: templates are untrusted code from the checkpoint, hence the
    immutable sandbox and the safer dict and namespace."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers' tojson keeps non-ASCII and HTML characters as is (jinja2's own escapes them for HTML).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    # Templates date their system prompt with it (Llama 3.1, Mistral Small): local time, as in transformers.
    return datetime.now().strftime(format)


class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %} marks the assistant's text for transformers' training masks;
    rendering keeps the block's text. A call block, as transformers parses it, so the block scopes alike."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _TemplateDict:
    """dict() and dict.fromkeys() without the dict type itself, which templates could otherwise inspect."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """A namespace that refuses underscore names, which could reach Python internals."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: namespace(self=...) stays a plain attribute
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")
