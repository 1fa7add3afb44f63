"""Secrets given as files (the API token, the KV handle key): read as text, with errors that name the flag."""
from __future__ import annotations

from pathlib import Path


def read_secret_file(path: str, flag: str) -> str:
    """The file's text, stripped; ValueError naming the flag and the file when it cannot be read, is not
    UTF-8 text (a secret is text, so that a file and an environment variable holding it agree) or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(
            f"{flag} {path} is not UTF-8 text: the secret must be text (e.g. made with `openssl rand -hex 32 > {path}`)"
        ) from None
    if not text:
        raise ValueError(f"{flag} {path} is empty")
    return text
