"""A reasoning model's thinking, set apart from its answer on /v1/chat/completions, as vLLM's
--reasoning-parser does: the text between `<think>` and `</think>` comes back as the message's `reasoning`
(and `reasoning_content`, its older name), the rest as its `content`.

Where thinking starts is read from the prompt as well as the output: DeepSeek-R1's template (and Qwen3's
thinking-only ones) end the prompt with an open `<think>`, so the output starts inside the thinking; Qwen3's
hybrid template lets the model open it (or closes an empty one in the prompt when thinking is off). Thinking
that never closes (the completion was cut short) is all reasoning."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.serving.text import tag_start_at_end

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser(enum.Enum):
    """vLLM's parser names for models that think between <think> and </think> (read alike here)."""

    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt (its last characters suffice) ends inside an open <think>."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def split_reasoning(text: str, opens_thinking: bool) -> tuple[str | None, str]:
    """A whole completion's (reasoning, content); reasoning None when the model did not think."""
    split = ReasoningStream(opens_thinking)
    pieces = [split.push(text), split.finish()]
    if not split.did_think:
        return None, text
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)


class ReasoningStream:
    """One completion's text split as it arrives: reasoning until </think>, content after. Characters that
    may begin a tag wait for the next piece."""

    def __init__(self, opens_thinking: bool):
        self._text = ""
        self._num_read = 0
        self._state = "start"
        self._opens_thinking = opens_thinking
        self.did_think = opens_thinking

    def push(self, text: str) -> Split:
        self._text += text
        split = Split()
        if self._state == "start":
            self._read_start()
        if self._state == "thinking":
            split.reasoning = self._read_thinking()
        if self._state == "answering":
            split.content = self._take(len(self._text))
        return split

    def finish(self) -> Split:
        """Whatever waited on a tag that never completed."""
        rest = self._take(len(self._text))
        is_thinking = self._state == "thinking" or (self._state == "start" and self._opens_thinking)
        return Split(reasoning=rest) if is_thinking else Split(content=rest)

    def _read_start(self) -> None:
        """The output's first characters: an opening <think> (after whitespace) starts thinking, and is left
        out where the prompt opened the thinking already; anything else is the answer, or the thinking the
        prompt opened."""
        body = self._text.lstrip()
        if body.startswith(THINK_OPEN):
            self._num_read = len(self._text) - len(body) + len(THINK_OPEN)
            self._state, self.did_think = "thinking", True
        elif body and not THINK_OPEN.startswith(body):
            self._state = "thinking" if self._opens_thinking else "answering"

    def _read_thinking(self) -> str:
        end = self._text.find(THINK_CLOSE, self._num_read)
        if end == -1:
            return self._take(len(self._text) - tag_start_at_end(self._text, THINK_CLOSE))
        reasoning = self._take(end)
        self._num_read = end + len(THINK_CLOSE)
        self._state = "answering"
        return reasoning

    def _take(self, end: int) -> str:
        piece = self._text[self._num_read:end] if end > self._num_read else ""
        self._num_read = max(self._num_read, end)
        return piece
