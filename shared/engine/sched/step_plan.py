"""One schedule() call's plan: the token and encoder budgets left, and the requests scheduled so
far with what each computes, as the running and waiting passes fill it in."""
from __future__ import annotations

from shared.engine.sched.encoder_budget import EncoderBudget
from shared.engine.sched.output import NewRequestData


class StepPlan:
    """One schedule() call's decisions as the running and waiting passes accumulate them
    (a plain slotted class: it is built every step)."""

    __slots__ = (
        "token_budget", "encoder_budget", "num_scheduled_tokens", "spec_decode_tokens", "encoder_inputs",
        "new_reqs", "cached_ids", "cached_new_blocks", "cached_computed", "preempted",
    )

    def __init__(self, token_budget: int, encoder_budget: EncoderBudget) -> None:
        self.token_budget = token_budget
        self.encoder_budget = encoder_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.spec_decode_tokens: dict[str, list[int]] = {}
        self.encoder_inputs: dict[str, list[int]] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_ids: list[str] = []
        self.cached_new_blocks: list[list[int] | None] = []
        self.cached_computed: list[int] = []
        self.preempted = False
