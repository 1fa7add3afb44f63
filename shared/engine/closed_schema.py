"""JSON schemas read as vLLM's default structured-output backend reads them: an object schema that declares
its properties and says nothing of additionalProperties takes no other keys (a schema that says otherwise,
additionalProperties true or a schema, keeps its word)."""
from __future__ import annotations

import copy
from typing import Any

# Keywords whose value maps names to subschemas, and keywords whose value is a subschema or a list of them
# (the JSON Schema 2020-12 applicators, as vLLM's guidance backend walks them).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
               "anyOf", "oneOf")


def closed_objects(schema: Any) -> Any:
    """A copy of schema in which every object schema with properties (or patternProperties) and no word on
    additionalProperties has additionalProperties false."""
    closed = copy.deepcopy(schema)
    _close(closed)
    return closed


def _close(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for subschema in node[key].values():
                if isinstance(subschema, dict):
                    _close(subschema)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), (dict, list)):
            _close(node[key])
    declares_keys = isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    if declares_keys and "additionalProperties" not in node:
        node["additionalProperties"] = False
