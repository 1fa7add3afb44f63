"""The one place a tokenizer is loaded: a tokenizer.json file, or the tokenizer.json inside a model directory.

The engine (text prompts to generate()), the router and the colocated service all load through here."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path, *, required: bool = True) -> Tokenizer | None:
    """ValueError when the file is missing or unreadable; a directory without tokenizer.json gives None
    unless required (a model directory need not carry one)."""
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
