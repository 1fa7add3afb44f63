"""Text <-> token ids for services that take text: encodes text prompts and turns streamed token ids into text
incrementally (a character split across tokens is emitted once it is complete)."""
from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)


class TextCodec:
    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "TextCodec":
        """Loads a tokenizer.json, or the tokenizer.json inside a model directory."""
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"tokenizer file not found: {file}")
        try:
            return cls(Tokenizer.from_file(str(file)))
        except Exception as exc:  # the tokenizers library raises its own exception types
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from None

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
