"""Where the built-in presets' tokenizer files live (torch-free, so the router can find them too)."""
from __future__ import annotations

from pathlib import Path

# One directory per preset: tokenizer.json + tokenizer_config.json (scripts/make_preset_tokenizers.py).
PRESET_TOKENIZERS = Path(__file__).resolve().parent / "presets"


def preset_tokenizer_dir(name: str) -> Path | None:
    """The directory of a built-in preset's tokenizer, or None when `name` is no preset."""
    if not name or "/" in name or name.startswith("."):
        return None
    directory = PRESET_TOKENIZERS / name
    return directory if (directory / "tokenizer.json").is_file() else None
