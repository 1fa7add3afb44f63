"""The async scheduler: schedules step N+1 before step N's output is back, booking output
placeholders for the tokens still in flight (and placeholder drafts when the runner speculates).
"""
from __future__ import annotations

from shared.engine.request import Request
from shared.engine.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """Scheduler for pipelined execution: several steps of one request may be in flight."""

    is_async = True

    def _book_placeholders(self, request: Request, num_spec: int) -> None:
        # A step that reaches the end of the known sequence (plus earlier placeholders and this
        # step's drafts) samples: its tokens are placeholders until the output returns.
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders + num_spec:
            request.num_output_placeholders += 1 + num_spec
            request.num_in_flight_samples += 1
            if self.num_spec_tokens:
                # The runner proposes the real drafts itself; the scheduler only reserves room.
                request.spec_token_ids = [-1] * self.num_spec_tokens
