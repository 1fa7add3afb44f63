"""The structured-output hook: a request may carry a grammar that must accept every sampled token.

The scheduler advances the grammar with each step's tokens; a grammar that rejects them ends the
request with FINISHED_ERROR. Grammar compilation and logit masking belong to the runner side.
"""
from __future__ import annotations

from typing import Protocol


class StructuredOutputGrammar(Protocol):
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over tokens; False when the grammar cannot accept them."""

    @property
    def error(self) -> str | None:
        """Why the grammar failed, once it has."""


class StructuredOutputRequest:
    """A request's grammar (None while it is still compiling)."""

    def __init__(self, grammar: StructuredOutputGrammar | None = None) -> None:
        self.grammar = grammar


class StructuredOutputManager:
    """Decides whether a request's grammar is advanced with its sampled tokens."""

    def should_advance(self, request) -> bool:
        so_request = request.structured_output_request
        return so_request is not None and so_request.grammar is not None

    def is_ready(self, request) -> bool:
        """A request with a grammar waits until the grammar exists."""
        so_request = request.structured_output_request
        return so_request is None or so_request.grammar is not None
