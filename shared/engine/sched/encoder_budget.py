"""The multimodal encoder budget of one step: which inputs a prompt chunk needs encoded, and how far
the chunk may reach before an input the budget cannot take.
"""
from __future__ import annotations

from shared.engine.request import Request


class EncoderBudget:
    """Encoder input tokens one step may still run (one per step, shared by all its requests)."""

    __slots__ = ("num_tokens_left", "disable_chunked_mm_input")

    def __init__(self, num_tokens: int, disable_chunked_mm_input: bool) -> None:
        self.num_tokens_left = num_tokens
        self.disable_chunked_mm_input = disable_chunked_mm_input

    def schedule(self, request: Request, num_computed: int, num_new: int) -> tuple[int, list[int]]:
        """Inputs overlapping [num_computed, num_computed + num_new) not encoded yet are charged to
        the budget; num_new shrinks to stop before an input that cannot run whole (or at all)."""
        scheduled: list[int] = []
        end = num_computed + num_new
        for index, pos in enumerate(request.mm_positions):
            start, length = pos.offset, pos.length
            if start >= end:
                break
            if start + length <= num_computed or index in request.encoder_inputs_done:
                continue
            if self.disable_chunked_mm_input and num_computed < start and end < start + length:
                num_new = start - num_computed
                break
            if length > self.num_tokens_left:
                num_new = start - num_computed if num_computed < start else 0
                break
            self.num_tokens_left -= length
            scheduled.append(index)
        return num_new, scheduled
