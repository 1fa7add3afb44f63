"""A completion's text as its tokens arrive: incremental detokenization and stop strings, cut the way
vLLM's detokenizer cuts them. The router and the colocated server both use it, so split and colocated
serving stop at the same token with the same text."""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.request import FinishReason, SamplingParams
from shared.serving.text import TextStream


@dataclass(frozen=True)
class TextDelta:
    """What to send for one batch of tokens: the tokens kept (none past the one completing a stop
    string), the text ready to stream, and the stop string that ended the completion, if any."""

    token_ids: list[int]
    text: str
    stop_string: str | None = None


class OutputText:
    """Per-completion text state. Without a text stream (no tokenizer) tokens pass through, text empty."""

    def __init__(self, stream: TextStream | None, params: SamplingParams):
        if params.stop and stream is None:
            raise ValueError("stop strings need a tokenizer to turn tokens into text")
        self._stream = stream
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # While a stop string may still complete, its first characters are held back from the stream.
        self._hold_back = max((len(s) for s in self._stop), default=1) - 1 if not self._include_stop else 0
        self._text = ""
        self._num_sent_chars = 0
        self._num_tokens = 0

    def push(self, token_ids: list[int], finish: FinishReason | None) -> TextDelta:
        """finish: how the engine finished the completion with these tokens (then everything held back goes
        out). A stop token (EOS, stop_token_ids) ends it without adding its text, as in vLLM, unless
        include_stop_str_in_output."""
        if self._stream is None:
            return TextDelta(list(token_ids), "")
        is_last = finish is not None
        num_texted = len(token_ids) - (finish is FinishReason.STOP and not self._include_stop)
        kept = []
        for index, token_id in enumerate(token_ids):
            kept.append(token_id)
            self._num_tokens += 1
            if index >= num_texted:
                break
            piece = self._stream.push([token_id])
            self._text += piece
            stop_string = self._check_stop(len(piece))
            if stop_string is not None:
                return TextDelta(kept, self._take(is_last=True), stop_string)
        if is_last:  # bytes of a character that never completed go out as the whole decode renders them
            self._text += self._stream.push([], final=True)
        return TextDelta(kept, self._take(is_last))

    def _check_stop(self, num_new_chars: int) -> str | None:
        """vLLM's rule: stop strings are looked for only past min_tokens, within the new characters (and
        the stop's length before them), first match in the order given; the text is cut at the match."""
        if not self._stop or not num_new_chars or self._num_tokens <= self._min_tokens:
            return None
        for stop in self._stop:
            index = self._text.find(stop, max(0, len(self._text) - num_new_chars - len(stop) + 1))
            if index == -1:
                continue
            end = index + len(stop) if self._include_stop else index
            self._text = self._text[:end]
            return stop
        return None

    def _take(self, is_last: bool) -> str:
        end = len(self._text) if is_last else max(self._num_sent_chars, len(self._text) - self._hold_back)
        text = self._text[self._num_sent_chars:end]
        self._num_sent_chars = end
        return text

    @property
    def text(self) -> str:
        """Everything streamed so far."""
        return self._text[:self._num_sent_chars]
