"""Applying a step's results: sampled tokens, stop conditions, draft acceptance, stale in-flight
output after a preemption, and the KV connector's report (finished sends/loads, failed blocks).
"""
from __future__ import annotations

import time

from shared.engine.kv_transfer.connector import KVLoadFailurePolicy
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.sched.output import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from shared.engine.sched.stats import SpecDecodingStats

_EMPTY: list[int] = []
_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


class SchedulerUpdateMixin:
    """The update half of Scheduler (see shared/engine/sched/scheduler.py for the state it works on)."""
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's results: append tokens, check stops, retire finished requests."""
        kv_output = model_runner_output.kv_connector_output
        outputs: list[EngineCoreOutput] = []
        finished_now: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            self._handle_invalid_blocks(kv_output.invalid_block_ids, outputs, finished_now)

        sampled_all = model_runner_output.sampled_token_ids
        spec_all = model_runner_output.spec_token_ids
        index_of = model_runner_output.req_id_to_index
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        spec_stats: SpecDecodingStats | None = None
        requests = self.requests
        max_model_len = self.max_model_len
        so_manager = self.structured_output_manager

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
                num_drafts = len(drafts) if drafts else 0
                if num_drafts:
                    num_accepted = len(sampled) - 1
                    request.num_computed_tokens -= num_drafts - num_accepted
                    if spec_stats is None:
                        spec_stats = SpecDecodingStats.new(self.num_spec_tokens)
                    spec_stats.observe_draft(num_drafts, num_accepted)
                if request.num_output_placeholders:
                    left = request.num_output_placeholders - 1 - num_drafts
                    request.num_output_placeholders = left if left > 0 else 0
                    if request.num_in_flight_samples:
                        request.num_in_flight_samples -= 1
                new_tokens = self._append_and_check_stop(request, sampled, max_model_len)
                if new_tokens and request.structured_output_request is not None and so_manager.should_advance(
                    request
                ):
                    if not request.structured_output_request.grammar.accept_tokens(req_id, new_tokens):
                        request.status = RequestStatus.FINISHED_ERROR
                        request.resumable = False
            if spec_all is not None and index is not None and not self.is_async:
                request.spec_token_ids = list(spec_all[index] or ())
            plp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if request.status != _RUNNING:
                finished_now.add(req_id)
                request.spec_token_ids = []
                kv_params = self._free_request(request)
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_tokens,
                        request.get_finished_reason(),
                        request.stop_reason,
                        kv_params,
                        plp,
                        0,
                    )
                )
            elif new_tokens or plp is not None:
                outputs.append(EngineCoreOutput(req_id, new_tokens, None, None, None, plp, 0))

        if finished_now:
            self.running = [r for r in self.running if r.request_id not in finished_now]
        if kv_output is not None:
            self._apply_kv_connector_output(kv_output)
        stats = self.make_stats(spec_stats) if self.log_stats else None
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, finished_requests=finished_now)

    def _append_and_check_stop(self, request: Request, sampled: list[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the first stop; return the tokens kept."""
        stop_ids = request._stop_ids
        out = request._output_token_ids
        all_ids = request._all_token_ids
        if len(sampled) == 1:
            token = sampled[0]
            out.append(token)
            all_ids.append(token)
            if token in stop_ids:
                self._set_stopped(request, token)
            elif len(out) >= request.max_tokens or len(all_ids) >= max_model_len:
                request.status = _LENGTH
            return sampled
        kept = []
        for token in sampled:
            out.append(token)
            all_ids.append(token)
            kept.append(token)
            if token in stop_ids:
                self._set_stopped(request, token)
                break
            if len(out) >= request.max_tokens or len(all_ids) >= max_model_len:
                request.status = _LENGTH
                break
        return kept

    @staticmethod
    def _set_stopped(request: Request, token: int) -> None:
        request.status = _STOPPED
        # EOS is the natural end: no stop reason. A stop token is reported as the reason.
        if token == request.eos_token_id and not request.sampling_params.ignore_eos:
            request.stop_reason = None
        else:
            request.stop_reason = token

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
        new_tokens = self._append_and_check_stop(request, sampled, self.max_model_len)
        if request.is_finished():
            self.waiting.remove(request)
            finished_now.add(request.request_id)
            kv_params = self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, new_tokens, request.get_finished_reason(), request.stop_reason, kv_params
                )
            )
        else:
            outputs.append(EngineCoreOutput(request.request_id, new_tokens))

    def _free_request(self, request: Request, load_in_flight: bool = False) -> dict | None:
        """Retire a finished request: the connector decides whether its blocks stay held for a peer."""
        req_id = request.request_id
        delay_free, kv_params = False, None
        if self.connector is not None:
            delay_free, kv_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)
            )
        self.requests.pop(req_id, None)
        self.finished_req_ids.add(req_id)
        if req_id in self._finished_recving:
            load_in_flight = False  # the load already landed
            self._finished_recving.discard(req_id)
        if delay_free:
            self._held[req_id] = request
        elif load_in_flight:
            self._abandoned_loads[req_id] = request  # the load may still write into its blocks
        else:
            self.kv_cache_manager.free(request)
        return kv_params

    def _apply_kv_connector_output(self, kv_output: KVConnectorOutput) -> None:
        for req_id in kv_output.finished_recving or ():
            abandoned = self._abandoned_loads.pop(req_id, None)
            if abandoned is not None:
                self.kv_cache_manager.free(abandoned)
            elif req_id in self.requests:
                self._finished_recving.add(req_id)
        for req_id in kv_output.finished_sending or ():
            held = self._held.pop(req_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)

    def _handle_invalid_blocks(
        self, bad_block_ids: set[int], outputs: list[EngineCoreOutput], finished_now: set[str]
    ) -> None:
        """Blocks whose KV load failed: recompute from the first bad block, or fail the request."""
        now = time.monotonic()
        for request in list(self.requests.values()):
            first_bad = self.kv_cache_manager.invalidate_blocks(request, bad_block_ids)
            if first_bad is None:
                continue
            if self.kv_load_failure_policy == KVLoadFailurePolicy.FAIL:
                self._finish_with_error(request, outputs, finished_now)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.num_pending_computed_tokens = min(
                    request.num_pending_computed_tokens, first_bad * self.block_size
                )
            elif request.status == _RUNNING:
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
        kv_params = self._free_request(request, load_in_flight=was_loading)
        outputs.append(EngineCoreOutput(request.request_id, [], FinishReason.ERROR, None, kv_params))
