"""Applying a step's results in the scheduler: sampled tokens appended and stop conditions checked,
drafts accepted, stale output of preempted steps, failed KV loads, and finished requests retired."""
from __future__ import annotations

import time
from collections import deque

from shared.engine.kv_transfer.handle import KvPullStats
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.sched.output import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from shared.engine.sched.remote_kv import RemoteKvTracker
from shared.engine.sched.stats import SpecDecodingStats
from shared.engine.structured_output import StructuredOutputManager

_EMPTY: list[int] = []
_RUNNING = RequestStatus.RUNNING


class StepResults:
    """Part of Scheduler (its base): the state below is the Scheduler's; _free_request,
    _preempt_request and make_stats are its own."""

    is_async: bool
    log_stats: bool
    max_model_len: int
    remote_kv: RemoteKvTracker
    structured_output_manager: StructuredOutputManager
    requests: dict[str, Request]
    _pull_stats: dict[str, KvPullStats]  # req_id -> how its KV load went, until its next output carries it
    waiting: deque[Request]
    running: list[Request]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's results: append tokens, check stops, retire finished requests."""
        kv_output = model_runner_output.kv_connector_output
        outputs: list[EngineCoreOutput] = []
        finished_now: set[str] = set()
        if kv_output is not None and kv_output.pull_stats:
            self._note_pull_stats(kv_output.pull_stats)
        if kv_output is not None and kv_output.invalid_block_ids:
            self._handle_invalid_blocks(kv_output.invalid_block_ids, outputs, finished_now)

        sampled_all = model_runner_output.sampled_token_ids
        spec_all = model_runner_output.spec_token_ids
        index_of = model_runner_output.req_id_to_index
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        sampled_logprobs = model_runner_output.logprobs
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        spec_stats: SpecDecodingStats | None = None
        requests = self.requests

        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue  # finished while this step was in flight
            in_flight = request.num_in_flight_tokens - num_scheduled
            request.num_in_flight_tokens = in_flight if in_flight > 0 else 0
            index = index_of.get(req_id)
            sampled = sampled_all[index] if index is not None else _EMPTY
            if request.num_stale_output_tokens:
                self._apply_stale_output(request, num_scheduled, sampled, outputs, finished_now)
                continue
            if request.status != _RUNNING:
                continue
            new_tokens = _EMPTY
            if sampled:
                drafts = spec_scheduled.get(req_id) if spec_scheduled else None
                new_tokens, spec_stats = self._apply_sampled(request, sampled, len(drafts) if drafts else 0,
                                                             spec_stats)
            if spec_all is not None and index is not None and not self.is_async:
                request.spec_token_ids = list(spec_all[index] or ())
            plp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            lps = sampled_logprobs.get(req_id) if sampled_logprobs and new_tokens else None
            if lps is not None:
                lps = lps[:len(new_tokens)]
            if request.status != _RUNNING:
                outputs.append(self._finished_output(request, new_tokens, plp, lps, finished_now))
            elif new_tokens or plp is not None:
                outputs.append(EngineCoreOutput(req_id, new_tokens, None, None, None, plp, lps))

        if finished_now:
            self.running = [r for r in self.running if r.request_id not in finished_now]
        if kv_output is not None:  # a connector's step
            self.remote_kv.apply_connector_output(kv_output, self.requests)
            if self._pull_stats and outputs:
                self._attach_pull_stats(outputs)
        stats = self.make_stats(spec_stats) if self.log_stats else None
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, finished_requests=finished_now)

    def _note_pull_stats(self, pull_stats: dict[str, KvPullStats]) -> None:
        """How each request's KV load went, kept until the request's next output (an aborted one has none)."""
        for req_id, stats in pull_stats.items():
            if req_id in self.requests:
                self._pull_stats[req_id] = stats

    def _attach_pull_stats(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            stats = self._pull_stats.pop(output.request_id, None)
            if stats is not None:
                output.kv_pull = stats

    def _apply_sampled(
        self, request: Request, sampled: list[int], num_drafts: int, spec_stats: SpecDecodingStats | None
    ) -> tuple[list[int], SpecDecodingStats | None]:
        """Append a running request's sampled tokens (its stop conditions apply); the tokens kept."""
        if num_drafts:
            spec_stats = self._accept_drafts(request, num_drafts, len(sampled) - 1, spec_stats)
        if request.num_output_placeholders:
            left = request.num_output_placeholders - 1 - num_drafts
            request.num_output_placeholders = left if left > 0 else 0
            if request.num_in_flight_samples:
                request.num_in_flight_samples -= 1
        new_tokens = request.append_sampled_token_ids(sampled, self.max_model_len)
        if new_tokens and request.structured_output_request is not None:
            self._advance_grammar(request, new_tokens)
        return new_tokens, spec_stats

    def _finished_output(self, request: Request, new_tokens: list[int], plp, lps,
                         finished_now: set[str]) -> EngineCoreOutput:
        """Retire a request this step finished; its last output, with the KV handle a peer pulls."""
        finished_now.add(request.request_id)
        request.spec_token_ids = []
        kv_handle = self._free_request(request)
        return EngineCoreOutput(
            request.request_id, new_tokens, request.get_finished_reason(), request.stop_reason, kv_handle, plp, lps,
            request.error,
        )

    def _accept_drafts(
        self, request: Request, num_drafts: int, num_accepted: int, spec_stats: SpecDecodingStats | None
    ) -> SpecDecodingStats:
        """Rejected drafts were computed for nothing: their positions are computed again."""
        request.num_computed_tokens -= num_drafts - num_accepted
        if spec_stats is None:
            spec_stats = SpecDecodingStats()
        spec_stats.observe_draft(num_drafts, num_accepted)
        return spec_stats

    def _advance_grammar(self, request: Request, new_tokens: list[int]) -> None:
        """A grammar that rejects the sampled tokens ends the request with an error."""
        if not self.structured_output_manager.should_advance(request):
            return
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens(request.request_id, new_tokens):
            request.status = RequestStatus.FINISHED_ERROR
            request.resumable = False
            request.error = f"the structured output constraint failed: {grammar.error}"

    def _apply_stale_output(
        self,
        request: Request,
        num_scheduled: int,
        sampled: list[int],
        outputs: list[EngineCoreOutput],
        finished_now: set[str],
    ) -> None:
        """Output of a step scheduled before the request was preempted."""
        stale = request.num_stale_output_tokens - num_scheduled
        request.num_stale_output_tokens = stale if stale > 0 else 0
        if request.drop_stale_output or not sampled:
            return
        # Deliver losslessly: the request recomputes from its tokens, these included.
        new_tokens = request.append_sampled_token_ids(sampled, self.max_model_len)
        if request.is_finished():
            self.waiting.remove(request)
            finished_now.add(request.request_id)
            kv_handle = self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, new_tokens, request.get_finished_reason(), request.stop_reason, kv_handle
                )
            )
        else:
            outputs.append(EngineCoreOutput(request.request_id, new_tokens))

    def _handle_invalid_blocks(
        self, bad_block_ids: set[int], outputs: list[EngineCoreOutput], finished_now: set[str]
    ) -> None:
        """Blocks whose KV load failed: recompute from the first bad block, or fail the request."""
        to_fail, to_recompute = self.remote_kv.triage_load_failures(list(self.requests.values()), bad_block_ids)
        for request in to_fail:
            self._finish_with_error(request, outputs, finished_now)
        now = time.monotonic()
        for request in to_recompute:
            # Loaded synchronously into a step that already ran on bad KV: that step's output
            # is dropped and the request recomputes (its good blocks stay prefix-cached).
            self.running.remove(request)
            self._preempt_request(request, now, drop_stale_output=True)

    def _finish_with_error(self, request: Request, outputs: list[EngineCoreOutput], finished_now: set[str]) -> None:
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status == _RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.resumable = False
        finished_now.add(request.request_id)
        kv_handle = self._free_request(request, load_in_flight=was_loading)
        outputs.append(EngineCoreOutput(request.request_id, [], FinishReason.ERROR, None, kv_handle))
