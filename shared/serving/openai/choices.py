"""How one endpoint dresses generation chunks (completions: text; chat: message or delta, with tool calls
and reasoning read apart) for the n choices of one request: one OpenAI choice per completion index, usage
over all of them; streamed chunk by chunk, or whole once every chunk is in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.engine.request import FinishReason, TokenLogprobs
from shared.serving.generation import GenerateChunk
from shared.serving.openai import objects
from shared.serving.openai.protocol import StreamOptions
from shared.serving.openai.reasoning import ReasoningStream, split_reasoning
from shared.serving.openai.tool_calls import ToolCallStream, ToolRequest, tool_call_objects


@dataclass
class _Choice:
    """One of the request's n completions, as its chunks arrive."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: FinishReason | None = None
    num_output_tokens: int = 0
    text_offset: int = 0  # completions' logprobs: where the next token starts in this choice's text
    has_started: bool = False
    tool_calls: ToolCallStream | None = None  # chat with tools: its text read for tool calls as it streams
    reasoning: ReasoningStream | None = None  # chat with a reasoning parser: its thinking read apart


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt: its text, its first token (which has no logprob) and whether the
    completion itself is left out (max_tokens 0)."""

    text: str
    first_token_id: int
    without_output: bool


@dataclass(frozen=True)
class ParsedRequest:
    """What the front needs of one parsed OpenAI request besides its generation inputs."""

    options: StreamOptions
    wants_logprobs: bool
    n: int = 1  # completions per prompt
    tools: ToolRequest | None = None  # chat only
    echoes: tuple[Echo, ...] = ()  # completions with echo: one per prompt
    opens_thinking: bool | None = None  # chat with a reasoning parser: whether the prompt ends inside <think>


class Choices:
    """The choices of one request's answer, built from its chunks."""

    def __init__(self, is_chat: bool, model: str, parsed: ParsedRequest, token_texts: objects.TokenTexts,
                 token_bytes: objects.TokenBytes | None = None):
        self.is_chat = is_chat
        self.ids = objects.ResponseIds.new("chatcmpl" if is_chat else "cmpl", model)
        self._wants_logprobs = parsed.wants_logprobs
        self._tools = parsed.tools if parsed.tools is not None and parsed.tools.reads_calls else None
        self._n = parsed.n
        self._echoes = parsed.echoes
        self._opens_thinking = parsed.opens_thinking
        self._token_texts = token_texts
        self._token_bytes = token_bytes
        self._choices: dict[int, _Choice] = {}
        self._num_prompt_tokens: dict[int, int] = {}  # by prompt (a batch of completions has several)

    def _choice_of(self, chunk: GenerateChunk) -> _Choice:
        """The chunk's choice, its token count brought up to date."""
        choice = self._choices.get(chunk.index)
        if choice is None:
            choice = self._choices[chunk.index] = _Choice(chunk.index)
            choice.tool_calls = self._tools.stream() if self._tools is not None else None
            if self._opens_thinking is not None:
                choice.reasoning = ReasoningStream(self._opens_thinking)
        echo = self._echo_of(choice)
        without_output = echo is not None and echo.without_output  # its one sampled token is not returned
        choice.num_output_tokens = 0 if without_output else chunk.num_output_tokens
        self._num_prompt_tokens[chunk.index // self._n] = chunk.num_prompt_tokens  # the same for its n choices
        return choice

    def _logprobs(self, choice: _Choice, entries: list[TokenLogprobs | int]) -> dict[str, Any] | None:
        if not self._wants_logprobs:
            return None
        if self.is_chat:
            return objects.chat_logprobs(entries, self._token_texts, self._token_bytes)
        logprobs, choice.text_offset = objects.completion_logprobs(entries, self._token_texts, choice.text_offset)
        return logprobs

    def streamed(self, chunk: GenerateChunk) -> dict[str, Any] | None:
        """The stream event of one chunk: its choice, by index (chat: the role with the choice's first);
        None when it has nothing to say (its text waits to be read for tool calls)."""
        choice = self._choice_of(chunk)
        if self.is_chat:
            logprobs = self._logprobs(choice, chunk.logprobs)
            delta, finish_reason = self._chat_delta(choice, chunk.text, chunk.finish_reason)
            if not delta and finish_reason is None and logprobs is None:
                return None
            dressed = objects.chat_delta(choice.index, delta, finish_reason, logprobs)
        else:
            text, entries = self._completion_piece(choice, chunk)
            dressed = objects.completion_choice(choice.index, text, chunk.finish_reason,
                                                self._logprobs(choice, entries))
        choice.has_started = True
        return {**self.ids.envelope(self._object(chunk=True)), "choices": [dressed]}

    def _completion_piece(self, choice: _Choice, chunk: GenerateChunk) -> tuple[str, list]:
        """A completion chunk's text and logprob entries, after the echoed prompt on the choice's first."""
        text, entries = chunk.text, list(chunk.logprobs)
        echo = self._echo_of(choice)
        if echo is None:
            return text, entries
        if echo.without_output:
            text, entries = "", []
        if not choice.has_started:
            text = echo.text + text
            entries = [echo.first_token_id, *chunk.prompt_logprobs, *entries]
        return text, entries

    def _echo_of(self, choice: _Choice) -> Echo | None:
        return self._echoes[choice.index // self._n] if self._echoes else None

    def _chat_delta(self, choice: _Choice, text: str,
                    finish: FinishReason | None) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's delta (reasoning, content, or tool calls read from the text) and its finish reason."""
        finish_reason = objects.finish_reason_to_openai(finish)
        reasoning = ""
        if choice.reasoning is not None:
            split = choice.reasoning.push(text)
            if finish is not None:
                rest = choice.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, text = split.reasoning, split.content
        if choice.tool_calls is None:
            delta: dict[str, Any] = {"content": text} if text or not (choice.has_started or reasoning) else {}
        else:
            delta, finish_reason = self._tool_delta(choice, text, finish, finish_reason)
        if reasoning:
            delta = {**objects.reasoning_fields(reasoning), **delta}
        if not choice.has_started:
            delta = {"role": "assistant", **delta}
        return delta, finish_reason

    def _tool_delta(self, choice: _Choice, text: str, finish: FinishReason | None,
                    finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The content and tool calls read from a chat chunk's text so far."""
        read = choice.tool_calls.push(text)
        if finish is not None:
            rest = choice.tool_calls.finish()
            read.content += rest.content
            read.tool_calls += rest.tool_calls
            finish_reason = self._tools.finish_reason(finish_reason, choice.tool_calls.found_calls)
        delta = {"content": read.content} if read.content else {}
        if read.tool_calls:
            delta["tool_calls"] = read.tool_calls
        return delta, finish_reason

    def collect(self, chunk: GenerateChunk) -> None:
        choice = self._choice_of(chunk)
        text, entries = (chunk.text, chunk.logprobs) if self.is_chat else self._completion_piece(choice, chunk)
        choice.has_started = True
        choice.text += text
        choice.logprobs.extend(entries)
        choice.finish = chunk.finish_reason or choice.finish

    def whole(self) -> dict[str, Any]:
        """The response of everything collected: every choice in index order, and the usage."""
        dress = self._chat_choice if self.is_chat else self._completion_choice
        choices = [dress(choice) for choice in sorted(self._choices.values(), key=lambda c: c.index)]
        return {**self.ids.envelope(self._object(chunk=False)), "choices": choices, "usage": self.usage()}

    def _completion_choice(self, choice: _Choice) -> dict[str, Any]:
        return objects.completion_choice(choice.index, choice.text, choice.finish,
                                         self._logprobs(choice, choice.logprobs))

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        logprobs = self._logprobs(choice, choice.logprobs)
        finish_reason = objects.finish_reason_to_openai(choice.finish)
        reasoning, text = None, choice.text
        if self._opens_thinking is not None:
            reasoning, text = split_reasoning(text, self._opens_thinking)
            text = text if reasoning is None or text else None  # all thinking: no content, as vLLM
        if self._tools is None:
            return objects.chat_choice(choice.index, text, finish_reason, logprobs, reasoning=reasoning)
        content, calls = self._tools.calls_in(text) if text is not None else (None, [])
        finish_reason = self._tools.finish_reason(finish_reason, bool(calls))
        return objects.chat_choice(choice.index, content, finish_reason, logprobs, tool_call_objects(calls),
                                   reasoning)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.ids.envelope(self._object(chunk=True)), "choices": [], "usage": self.usage()}

    def usage(self) -> dict[str, int]:
        """Each prompt once, the output tokens of every choice."""
        num_output_tokens = sum(choice.num_output_tokens for choice in self._choices.values())
        return objects.usage(sum(self._num_prompt_tokens.values()), num_output_tokens)

    def _object(self, chunk: bool) -> str:
        if self.is_chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"
