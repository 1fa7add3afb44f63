"""The runner's per-request state: token lists and block-table rows kept in step with each
SchedulerOutput, and the requests one step computes, in batch order (single-token steps first)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from shared.engine.model.block_tables import BlockTables
from shared.engine.request import SamplingParams
from shared.engine.sched.output import SchedulerOutput


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + every output token known to the runner
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # the request's seed, or one the runner drew for it (so its samples stay batch-independent)
    table_row: int  # its row in the runner's BlockTables
    num_computed_tokens: int
    output_start: int  # index in token_ids of the first output token (penalties count from it)
    stop_token_ids: frozenset[int]  # EOS (unless ignored) and the stop tokens: what min_tokens holds back
    structured_output_request: object | None = None


@dataclass
class ScheduledRequest:
    req_id: str
    state: RequestState
    start: int  # position of the first token computed this step
    input_ids: list[int]
    drafts: list[int]
    samples: bool  # the step reaches the end of the known tokens, so it samples


class RequestStates:
    """Every request the runner holds, updated from each SchedulerOutput before the step runs."""

    def __init__(self, seed: int, eos_token_ids: frozenset[int]):
        self.eos_token_ids = eos_token_ids
        self._seed_source = random.Random(seed)
        self.requests: dict[str, RequestState] = {}
        self.block_tables = BlockTables()
        # req_id -> first prompt position whose logprobs are not reported yet (survives preemption).
        self.prompt_logprobs_next: dict[str, int] = {}

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._forget(req_id)
            self.prompt_logprobs_next.pop(req_id, None)
        for req_id in so.preempted_req_ids or ():
            self._forget(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
            self._forget(new.req_id)  # a request resumed without its preemption reported
            self.requests[new.req_id] = RequestState(
                token_ids=list(new.prefill_token_ids), num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params, seed=seed, table_row=self.block_tables.add(list(new.block_ids)),
                num_computed_tokens=new.num_computed_tokens,
                output_start=len(new.prompt_token_ids) - new.num_prior_output_tokens,
                stop_token_ids=self._stop_token_ids(params),
                structured_output_request=new.structured_output_request,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"scheduled cached request {req_id!r} is unknown to the runner")
            if cached.new_block_ids[i]:
                self.block_tables.extend(state.table_row, cached.new_block_ids[i])
            if cached.new_token_ids[i]:
                state.token_ids.extend(cached.new_token_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_tables.free(state.table_row)

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return frozenset(stop_ids)

    def schedule(self, so: SchedulerOutput, block_size: int) -> list[ScheduledRequest]:
        scheduled = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            if num_tokens <= 0:
                continue
            state = self.requests[req_id]
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            start = state.num_computed_tokens
            num_known = num_tokens - len(drafts)
            known = state.token_ids[start:start + num_known]
            if len(known) != num_known:
                raise ValueError(
                    f"request {req_id!r}: {num_known} tokens scheduled from position {start} but the runner "
                    f"knows only {len(state.token_ids)} tokens"
                )
            end = start + num_known + len(drafts)
            num_blocks = self.block_tables.num_blocks(state.table_row)
            if end > num_blocks * block_size:
                raise ValueError(f"request {req_id!r}: {end} tokens do not fit its {num_blocks} blocks")
            samples = start + num_known >= len(state.token_ids)
            scheduled.append(ScheduledRequest(req_id, state, start, known + drafts, drafts, samples))
        # Single-token steps first: they share one batched decode attention.
        scheduled.sort(key=lambda r: len(r.input_ids) > 1)
        return scheduled
