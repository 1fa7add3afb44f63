"""Reading a checkpoint's JSON files (config.json, generation_config.json, the weights' index): a file that
is not a JSON object, or a field of the wrong JSON type, is refused with an error naming the file and field.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# JSON type name -> test. bool is an int in Python, but a JSON true is no integer: "false" or 1 where a
# boolean belongs (or true where a count belongs) would otherwise be read as something it is not.
_IS_JSON_TYPE: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def read_json_object(path: Path) -> dict[str, Any]:
    """The file's top-level object; ValueError naming the file when it is unreadable or not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def check_field_types(fields: dict[str, Any], types: dict[str, tuple[str, ...]], source: str) -> None:
    """ValueError naming the first field of fields whose value is none of its JSON types (absent is fine)."""
    for name, allowed in types.items():
        if name in fields and not any(_IS_JSON_TYPE[kind](fields[name]) for kind in allowed):
            raise ValueError(f"{source}: {name} must be {' or '.join(allowed)}, got {fields[name]!r}")
