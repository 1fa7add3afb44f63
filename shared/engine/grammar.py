"""Grammars for structured output, compiled with llguidance: JSON schema, any JSON object, regex, Lark.

A Grammar is what the scheduler's structured-output hook advances with each sampled token and what the
runner asks for the tokens allowed next. llguidance computes the next-token mask on the CPU in tens of
microseconds and needs nothing but the tokenizer's JSON.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from shared.engine.closed_schema import closed_objects
from shared.engine.request import StructuredOutputSpec

# Compact JSON (no optional whitespace): a model cannot wander off into endless blanks.
_JSON_OPTIONS = {"whitespace_flexible": False}
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab/32)]: bit b of word w is token 32w + b (llguidance's layout)."""
    return torch.empty(num_rows, (vocab_size + 31) // 32, dtype=torch.int32)


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [num_rows, vocab_size], unpacked for every row at once."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


class Grammar:
    """One request's matcher. Not thread-safe: the engine thread alone uses it."""

    def __init__(self, matcher: LLMatcher, eos_token_ids: frozenset[int], on_error: Callable[[], None]):
        """on_error: called when the matcher fails. Copies of one start state share its lexer, and a
        lexer that gave up fails every copy, so the compiler drops that start state."""
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self._on_error = on_error

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over tokens; False (and the matcher stays in error) when the grammar rejects them."""
        for token in tokens:
            # A matcher that failed while computing its mask allows only EOS: that is no complete output.
            if self._matcher.is_error():
                break
            if token in self._eos_token_ids and self._matcher.is_stopped():
                continue  # a complete output allows only EOS, which the matcher no longer consumes
            if not self._matcher.consume_token(token):
                break
        else:
            return True
        self._on_error()
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens the grammar accepts next (only EOS once it is complete) into bitmask[row]."""
        self._matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.stride(0) * bitmask.element_size())

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar accepts next."""
        bitmask = allocate_bitmask(1, vocab_size)
        self.fill_bitmask(bitmask, 0)
        return allowed_from_bitmask(bitmask, vocab_size)[0]

    @property
    def error(self) -> str | None:
        """Why the matcher failed (llguidance's first line, without its state dump)."""
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiles StructuredOutputSpecs against one tokenizer (a tokenizers.Tokenizer). Clients repeat
    their schemas, so the last CACHED_GRAMMARS compiled ones are kept as matchers in their start state;
    a request gets a copy (llguidance shares the compiled grammar between copies)."""

    CACHED_GRAMMARS = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | list[int]):
        if not eos_token_ids:
            raise ValueError("structured output needs an end-of-sequence token to end a complete output")
        self._tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._eos_token_ids = frozenset(eos_token_ids)
        self._start_states: OrderedDict[StructuredOutputSpec, LLMatcher] = OrderedDict()

    def compile(self, spec: StructuredOutputSpec) -> Grammar:
        """ValueError naming the problem when the schema, regex or grammar is not valid."""
        start = self._start_states.get(spec)
        if start is None:
            start = self._compile_start_state(spec)
            self._start_states[spec] = start
            if len(self._start_states) > self.CACHED_GRAMMARS:
                self._start_states.popitem(last=False)
        else:
            self._start_states.move_to_end(spec)
        return Grammar(start.deep_copy(), self._eos_token_ids, lambda: self._start_states.pop(spec, None))

    def _compile_start_state(self, spec: StructuredOutputSpec) -> LLMatcher:
        try:
            grammar = self._grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"structured output: {exc}") from None
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {_first_line(matcher.get_error())}")
        return matcher

    @staticmethod
    def _grammar_text(spec: StructuredOutputSpec) -> str:
        if spec.json_schema is not None:
            try:
                # Undeclared keys are refused unless the schema allows them (vLLM's default backend does so).
                schema = closed_objects(json.loads(spec.json_schema))
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("json_schema nests too deeply to parse") from None
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        return LLMatcher.grammar_from_lark(_lark_of(spec.grammar))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _lark_of(grammar: str) -> str:
    """A Lark grammar as it is; a GBNF one (llama.cpp's `root ::= ...`, which vLLM takes too) converted by
    llguidance's own converter."""
    try:
        return any_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are the client's grammar's
        raise ValueError(f"the grammar is neither Lark nor GBNF: {_first_line(str(exc))}") from None
