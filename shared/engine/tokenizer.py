"""The one place a tokenizer is loaded: a tokenizer.json file, the tokenizer.json inside a model directory,
or the tokenizer a GGUF file's metadata describes.

The engine (text prompts to generate()), the router and the colocated service all load through here."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from shared.engine.model.gguf_metadata import GgufMetadata, gguf_path

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path, *, required: bool = True) -> Tokenizer | None:
    """ValueError when the file is missing or unreadable; a directory without tokenizer.json gives None
    unless required (a model directory need not carry one)."""
    gguf = gguf_path(path)
    if gguf is not None:
        from shared.engine.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(GgufMetadata.open(gguf))
    file = Path(path)
    if file.is_dir():
        file = file / TOKENIZER_FILE
        if not file.is_file() and not required:
            return None
    if not file.is_file():
        raise ValueError(f"tokenizer file not found: {file}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ValueError(f"cannot load tokenizer {file}: {exc}") from None
