"""Text <-> token ids for services that take text: encodes text prompts, renders chat messages with the
checkpoint's chat template, and turns streamed token ids into text incrementally (a character split across
tokens is emitted once it is complete)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.serving.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None):
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_path(cls, path: str) -> "TextCodec":
        """Loads a tokenizer.json, the tokenizer.json inside a model directory (with the chat template of
        its tokenizer_config.json), or a built-in preset's tokenizer by the preset's name."""
        file = preset_tokenizer_dir(path) or Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"tokenizer file not found: {file}")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises its own exception types
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from None
        return cls(tokenizer, _chat_template_beside(file))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def stream(self) -> "TextStream":
        return TextStream(self._tokenizer)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids of chat messages rendered with the chat template (ending in the assistant's turn).
        ValueError when there is no template or the template rejects the messages."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template (tokenizer_config.json with chat_template)")
        text = self.chat_template.render(messages)
        # The template already wrote the special tokens (bos, role markers): add none of our own.
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_template_beside(tokenizer_file: Path) -> ChatTemplate | None:
    """The chat template of the tokenizer_config.json next to tokenizer.json, when there is one."""
    config_file = tokenizer_file.parent / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_file}: {exc}") from None
    return ChatTemplate.from_tokenizer_config(config)


class TextStream:
    """Per-request incremental detokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        pieces = []
        for token_id in token_ids:
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception as exc:  # noqa: BLE001 - text is a convenience; token ids stay authoritative
                logger.debug("cannot detokenize %d: %s", token_id, exc)
                piece = None
            if piece:
                pieces.append(piece)
        return "".join(pieces)
