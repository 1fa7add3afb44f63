"""Text <-> token ids for services that take text: encodes text prompts, renders chat messages with the
checkpoint's chat template, and turns streamed token ids into text incrementally (a character split across tokens is emitted once it is complete, or as U+FFFD at the end of
the stream when it never completes, as transformers' decode() shows it)."""
from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from shared.engine.gguf_tokenizer import gguf_special_tokens, tokenizer_from_gguf
from shared.engine.model.fetched_presets import resolve_model_source
from shared.engine.model.gguf_metadata import GgufMetadata, gguf_path
from shared.engine.model.preset_files import preset_tokenizer_dir
from shared.engine.tokenizer import load_tokenizer
from shared.serving.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, ChatTemplate, ChatTemplateError

logger = logging.getLogger(__name__)


def encode_text(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The token ids of text. The batch call releases the GIL while it works (encode() holds it), so a
    worker thread tokenizing a long prompt does not stall the event loop; _fast skips the offsets."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel): the printable character standing for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


def tag_start_at_end(text: str, tag: str) -> int:
    """How many characters at the end of text could be the start of tag (text streamed before them is safe
    to send; they wait for the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None):
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_path(cls, path: str) -> "TextCodec":
        """Loads a tokenizer.json, the tokenizer.json inside a model directory (with the chat template found
        beside it, where transformers finds it), a GGUF file's (from its metadata), or a built-in preset's by
        the preset's name (ValueError if absent; a fetched preset is fetched first)."""
        path = resolve_model_source(path)
        gguf = gguf_path(path) if preset_tokenizer_dir(path) is None else None
        if gguf is not None:
            return cls.from_gguf(GgufMetadata.open(gguf))
        location = preset_tokenizer_dir(path) or Path(path)
        directory = location if location.is_dir() else location.parent
        return cls(load_tokenizer(location), ChatTemplate.from_directory(directory))

    @classmethod
    def from_gguf(cls, metadata: GgufMetadata) -> "TextCodec":
        """The tokenizer and chat template (tokenizer.chat_template) of a GGUF file's metadata."""
        source = metadata.get("tokenizer.chat_template")
        template = ChatTemplate(source, gguf_special_tokens(metadata)) if source else None
        return cls(tokenizer_from_gguf(metadata), template)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return encode_text(self._tokenizer, text)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids, special tokens left out unless asked (as an output's text)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's own bytes: a token holding part of a character has those bytes, where its text alone
        is U+FFFD (what OpenAI's logprobs `bytes` are for: rebuilding text split mid-character)."""
        return [self._bytes_of(token_id) for token_id in token_ids]

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tokenizer.decoder, ByteLevel) and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # SentencePiece's byte fallback, <0xE4>
            return bytes([int(byte.group(1), 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's text alone, special tokens included: how logprobs name tokens (as vLLM does)."""
        return self._tokenizer.decode_batch([[token_id] for token_id in token_ids], skip_special_tokens=False)

    def stream(self) -> "TextStream":
        return TextStream(self._tokenizer)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_variables: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The token ids of chat messages rendered with the chat template (ending in the assistant's turn
        unless add_generation_prompt is off; inside the last message with continue_final_message), with the
        tools the model may call. A content given as parts becomes one string, as vLLM gives it to templates
        that take strings. ChatTemplateError when there is no template or the template rejects the messages."""
        if self.chat_template is None:
            raise ChatTemplateError(f"the tokenizer has no chat template ({TEMPLATE_FILE}, or chat_template in "
                                    f"{TOKENIZER_CONFIG_FILE})")
        messages = [_with_text_content(index, message) for index, message in enumerate(messages)]
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, variables=template_variables,
                                         tools=tools)
        # The template already wrote the special tokens (bos, role markers): add none of our own.
        return encode_text(self._tokenizer, text, add_special_tokens=False)


# The text part types vLLM takes, and the field holding each one's text.
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                     "thinking": "thinking"}


def _with_text_content(index: int, message: dict) -> dict:
    """vLLM's "string" content format: a content given as parts is their texts joined with newlines."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(_part_texts(index, content))}


def _part_texts(index: int, parts: list) -> list[str]:
    """The texts of a content's parts, read as vLLM reads them: a part may be a plain string, a text part
    whose text is null is skipped, and any other part (image, audio) is refused: this server is text only."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        field = _TEXT_PART_FIELDS.get(part.get("type")) if isinstance(part, dict) else None
        if field is None:
            raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
        text = part.get(field)
        if text is None:
            continue
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{index}].content: a {part['type']!r} part's {field!r} must be a string")
        texts.append(text)
    return texts


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
