"""Chat templates from a checkpoint's tokenizer_config.json, rendered with jinja2 the way transformers
renders them (sandboxed, trim_blocks/lstrip_blocks, raise_exception, tojson)."""
from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception) or failed to render them."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers' tojson keeps non-ASCII as is (jinja2's own escapes it for HTML).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _special_token(value: Any) -> str:
    """tokenizer_config.json gives special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from None
        self._special_tokens = special_tokens

    @classmethod
    def from_tokenizer_config(cls, config: dict) -> "ChatTemplate | None":
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return cls(source, {name: _special_token(config.get(name)) for name in names})

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
