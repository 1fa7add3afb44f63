"""Text <-> token ids for services that take text: encodes text prompts and turns streamed token ids into text
incrementally (a character split across tokens is emitted once it is complete, or as U+FFFD at the end of
the stream when it never completes, as transformers' decode() shows it)."""
from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shared.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class TextCodec:
    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "TextCodec":
        """Loads a tokenizer.json, or the tokenizer.json inside a model directory (ValueError if absent)."""
        return cls(load_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def stream(self) -> "TextStream":
        return TextStream(self._tokenizer)


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
