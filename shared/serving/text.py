"""Text <-> token ids for services that take text: encodes text prompts, renders chat messages with the
checkpoint's chat template, and turns streamed token ids into text incrementally (a character split across tokens is emitted once it is complete, or as U+FFFD at the end of
the stream when it never completes, as transformers' decode() shows it)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.engine.tokenizer import load_tokenizer
from shared.serving.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None):
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_path(cls, path: str) -> "TextCodec":
        """Loads a tokenizer.json, the tokenizer.json inside a model directory (with the chat template of its
        tokenizer_config.json), or a built-in preset's by the preset's name (ValueError if absent)."""
        location = preset_tokenizer_dir(path) or Path(path)
        directory = location if location.is_dir() else location.parent
        return cls(load_tokenizer(location), _chat_template_in(directory))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's text alone, special tokens included: how logprobs name tokens (as vLLM does)."""
        return self._tokenizer.decode_batch([[token_id] for token_id in token_ids], skip_special_tokens=False)

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


def _chat_template_in(directory: Path) -> ChatTemplate | None:
    """The chat template of the directory's tokenizer_config.json, when it has one."""
    config_file = directory / "tokenizer_config.json"
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
        self._token_ids: list[int] = []
        self._pieces: list[str] = []  # text emitted so far

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """The text these tokens complete. final: the stream ends here, so text still held back for
        bytes that never came (an incomplete UTF-8 character) goes out as decode() renders it."""
        pieces = []
        for token_id in token_ids:
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception as exc:  # noqa: BLE001 - text is a convenience; token ids stay authoritative
                logger.debug("cannot detokenize %d: %s", token_id, exc)
                piece = None
            if piece:
                pieces.append(piece)
        self._token_ids.extend(token_ids)
        if final:
            pieces.append(self._held_back(pieces))
        text = "".join(pieces)
        self._pieces.append(text)
        return text

    def _held_back(self, pieces: list[str]) -> str:
        emitted = "".join(self._pieces + pieces)
        full = self._tokenizer.decode(self._token_ids, skip_special_tokens=True)
        if not full.startswith(emitted):  # a decoder whose stream and whole decode differ: keep the stream's
            logger.debug("streamed text is not a prefix of the decoded text; nothing added at the end")
            return ""
        return full[len(emitted):]
