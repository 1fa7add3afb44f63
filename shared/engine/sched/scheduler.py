"""The scheduler: continuous batching with chunked prefill, prefix caching, preemption by
recompute, stop conditions, speculative-decoding verification and the KV-connector roles.

Usage (one per engine):
    scheduler = Scheduler(scheduler_config, cache_config, connector=None, eos_token_id=2, log_stats=True)
    scheduler.add_request(Request(...))
    while scheduler.has_requests():
        out = scheduler.schedule()                       # SchedulerOutput: what to compute this step
        runner_out = runner.execute(out)                 # ModelRunnerOutput (+ KVConnectorOutput)
        eco = scheduler.update_from_output(out, runner_out)  # EngineCoreOutputs: tokens, finishes
Several steps may be in flight: schedule() again before the older output is applied.
The waiting pass is admission.py's and applying results step_results.py' (the class's bases).
Collaborators: the KV-cache manager (blocks), RemoteKvTracker (KV crossing engines) and
EncoderBudget (multimodal inputs per step); a Request applies its own stop conditions.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from shared.engine.kv_cache.manager import KVCacheManager, KVCacheUsage
from shared.engine.kv_transfer.connector import KVConnectorBase, KVLoadFailurePolicy
from shared.engine.kv_transfer.handle import KvPullStats
from shared.engine.kv_transfer.handoff import HoldForPeer, hands_off
from shared.engine.request import DuplicateRequestError, Request, RequestStatus
from shared.engine.sched.encoder_budget import EncoderBudget
from shared.engine.sched.admission import WaitingAdmission
from shared.engine.sched.output import CachedRequestData, SchedulerOutput
from shared.engine.sched.remote_kv import RemoteKvTracker
from shared.engine.sched.stats import SchedulerStats, SpecDecodingStats
from shared.engine.sched.step_plan import StepPlan
from shared.engine.sched.step_results import StepResults
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.structured_output import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler(WaitingAdmission, StepResults):
    """Decides each step which requests compute how many tokens, and applies the results."""

    # Async scheduling (AsyncScheduler) books output placeholders for steps in flight.
    is_async = False

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorBase | None = None,
        eos_token_id: int | None = None,
        log_stats: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.connector = connector
        self.eos_token_id = eos_token_id
        self.log_stats = log_stats
        self.structured_output_manager = structured_output_manager or StructuredOutputManager()

        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_encoder_input_tokens = scheduler_config.encoder_budget
        self.num_spec_tokens = scheduler_config.num_speculative_tokens
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_seed=cache_config.prefix_hash_seed,
        )
        # The connector's policy is the pod's setting (PodConfig.kv_load_failure_policy); without a connector
        # nothing loads remotely, so there is no policy.
        self.remote_kv = RemoteKvTracker(
            self.kv_cache_manager, connector.load_failure_policy if connector is not None else None
        )

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished / preempted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self._num_preemptions = 0
        self._pull_stats: dict[str, KvPullStats] = {}  # see StepResults._note_pull_stats

    # ---- properties ---------------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        """True when a finished request hands its KV to a peer (kv_producer, kv_both): then a
        preempted request's stale in-flight output is dropped instead of delivered."""
        return self.connector is not None and self.connector.role.requires_kv_delivery

    @property
    def kv_load_failure_policy(self) -> KVLoadFailurePolicy | None:
        return self.remote_kv.failure_policy

    @kv_load_failure_policy.setter
    def kv_load_failure_policy(self, policy: KVLoadFailurePolicy) -> None:
        self.remote_kv.failure_policy = KVLoadFailurePolicy(policy)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or self.remote_kv.is_held(request.request_id):
            raise DuplicateRequestError(f"request {request.request_id!r} is already scheduled")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no "
                f"room to generate within max_model_len {self.max_model_len}"
            )
        if self.scheduler_config.disable_chunked_mm_input:
            for pos in request.mm_positions:
                if pos.length > self.max_num_scheduled_tokens or pos.length > self.max_num_encoder_input_tokens:
                    raise ValueError(
                        f"request {request.request_id!r}: a multimodal input of {pos.length} tokens cannot "
                        "be scheduled whole with disable_chunked_mm_input"
                    )
        if request.eos_token_id is None and self.eos_token_id is not None:
            request.set_eos_token_id(self.eos_token_id)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside (abort, or a stop the engine detected). Unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests needs a finished status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        leaving_running = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self._pull_stats.pop(req_id, None)
            if request.status == _RUNNING:
                leaving_running.add(req_id)
            else:
                self.waiting.remove(request)
            was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            request.status = finished_status
            self._free_request(request, load_in_flight=was_loading)
        if leaving_running:
            self.running = [r for r in self.running if r.request_id not in leaving_running]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids) or bool(self._preempted_req_ids)

    def has_requests(self) -> bool:
        """Work left for schedule(): unfinished requests, or finished ones the runner must drop.
        (Held producer blocks are not work: see num_held_requests.)"""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @property
    def num_held_requests(self) -> int:
        return self.remote_kv.num_held_requests

    def get_kv_usage(self) -> KVCacheUsage:
        """Pool usage for metrics; num_held_blocks counts blocks kept for a peer's pull."""
        usage = self.kv_cache_manager.get_usage()
        return KVCacheUsage(
            num_total_blocks=usage.num_total_blocks,
            num_free_blocks=usage.num_free_blocks,
            num_used_blocks=usage.num_used_blocks,
            num_cached_blocks=usage.num_cached_blocks,
            num_held_blocks=self.remote_kv.num_held_blocks,
        )

    # ---- schedule -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(
            self.max_num_scheduled_tokens,
            EncoderBudget(self.max_num_encoder_input_tokens, self.scheduler_config.disable_chunked_mm_input),
        )
        now = time.monotonic()
        self._schedule_running(plan, now)
        # Waiting requests only when nothing was preempted this step (it would just bounce back).
        if not plan.preempted and self.waiting:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan, now: float) -> None:
        """Running requests first, in arrival order; the tail is preempted under KV pressure."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        allocate = self.kv_cache_manager.allocate_slots
        commit = self._commit
        add_cached_id = plan.cached_ids.append
        add_cached_blocks = plan.cached_new_blocks.append
        add_cached_computed = plan.cached_computed.append
        running = self.running
        index = 0
        while index < len(running) and plan.token_budget > 0:
            request = running[index]
            index += 1
            if request.num_in_flight_samples and (
                request.num_output_tokens + request.num_in_flight_samples >= request.max_tokens
                or request.num_tokens + request.num_in_flight_samples >= max_model_len
            ):
                continue  # everything it may still emit is already in flight
            num_computed = request.num_computed_tokens
            num_new = request.num_tokens_with_spec + request.num_output_placeholders - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > plan.token_budget:
                num_new = plan.token_budget
            if num_new > max_model_len - num_computed:
                num_new = max_model_len - num_computed
            encoder_indices = None
            if request.mm_positions and num_new > 0:
                num_new, encoder_indices = plan.encoder_budget.schedule(request, num_computed, num_new)
            if num_new <= 0:
                continue
            while True:
                new_block_ids = allocate(request, num_new)
                if new_block_ids is not None:
                    break
                victim = running.pop()
                self._preempt_request(victim, now)
                plan.preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            add_cached_id(request.request_id)
            add_cached_blocks(new_block_ids or None)
            add_cached_computed(num_computed)
            num_spec = self._take_spec_tokens(plan, request, num_computed, num_new) if request.spec_token_ids else 0
            commit(plan, request, num_computed, num_new, encoder_indices, num_spec)

    def _take_spec_tokens(self, plan: StepPlan, request: Request, num_computed: int, num_new: int) -> int:
        """Move the draft tokens this step verifies into the plan; their count."""
        num_spec = num_new + num_computed - request.num_tokens - request.num_output_placeholders
        if num_spec > 0:
            plan.spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []
        return max(num_spec, 0)

    def _commit(
        self,
        plan: StepPlan,
        request: Request,
        num_computed: int,
        num_new: int,
        encoder_indices: list[int] | None,
        num_spec: int,
    ) -> None:
        """The bookkeeping every scheduled request ends with, running or newly admitted."""
        req_id = request.request_id
        plan.num_scheduled_tokens[req_id] = num_new
        plan.token_budget -= num_new
        if encoder_indices:
            plan.encoder_inputs[req_id] = encoder_indices
            request.encoder_inputs_done.update(encoder_indices)
        request.num_computed_tokens = num_computed + num_new
        request.num_in_flight_tokens += num_new
        if self.is_async:
            self._book_placeholders(request, num_spec)

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        cached = CachedRequestData(
            req_ids=plan.cached_ids,
            new_token_ids=[()] * len(plan.cached_ids),  # the runner tracks the tokens it sampled
            new_block_ids=plan.cached_new_blocks,
            num_computed_tokens=plan.cached_computed,
        )
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - plan.token_budget,
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
            scheduled_encoder_inputs=plan.encoder_inputs,
            num_common_prefix_blocks=[self.kv_cache_manager.get_num_common_prefix_blocks(self.running)],
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
        )
        self.finished_req_ids = set()
        self._preempted_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _book_placeholders(self, request: Request, num_spec: int) -> None:
        """Async hook: account for the output of a step that has not come back yet."""

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool | None = None) -> None:
        """Free the request's blocks and send it back to the front of the queue to recompute.

        Output of its steps still in flight becomes stale: dropped when drop_stale_output (a
        producer, where delivering it would hand off freed blocks, or a caller that resumes the
        request at once), otherwise delivered and the request resumes only after it arrived."""
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.encoder_inputs_done.clear()
        if request.num_in_flight_tokens > 0:
            drop = self.requires_kv_delivery if drop_stale_output is None else drop_stale_output
            if request.num_stale_output_tokens > 0 and request.drop_stale_output:
                drop = True  # a share already being dropped stays dropped
            request.num_stale_output_tokens = request.num_in_flight_tokens
            request.drop_stale_output = drop
        request.num_output_placeholders = 0
        request.num_in_flight_samples = 0
        self.waiting.appendleft(request)
        self._preempted_req_ids.add(request.request_id)
        self._num_preemptions += 1

    # ---- retiring -----------------------------------------------------------------------------
    def _free_request(self, request: Request, load_in_flight: bool = False):
        """Retire a finished request: the connector decides whether its blocks stay held for a peer;
        returns the handle a peer pulls them with (None when nothing was handed off)."""
        req_id = request.request_id
        delay_free, kv_handle = False, None
        if self.connector is not None:
            if isinstance(request.kv_transfer_params, HoldForPeer) and not hands_off(request, self.max_model_len):
                request.kv_transfer_params = None  # nothing follows on a peer: no hold, the blocks free at once
            delay_free, kv_handle = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)
            )
        self.requests.pop(req_id, None)
        self.finished_req_ids.add(req_id)
        self.remote_kv.retire(request, delay_free, load_in_flight)
        return kv_handle

    # ---- maintenance --------------------------------------------------------------------------
    def release_held(self, request_ids: Iterable[str] | None = None) -> set[str]:
        """Free blocks held for a peer without waiting for the connector (cancellation, shutdown);
        None releases every hold. Returns the ids released. The connector's own hold record is
        the caller's to drop."""
        return self.remote_kv.release_held(request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget all cached prefixes. With reset_running_requests, running requests are preempted
        first (their in-flight output is dropped: they resume at once and resample it).
        Returns False when blocks are still in use (nothing is reset then)."""
        if reset_running_requests:
            now = time.monotonic()
            while self.running:
                self._preempt_request(self.running.pop(), now, drop_stale_output=True)
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.get_usage().usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.take_prefix_cache_stats(),
            spec_decoding_stats=spec_decoding_stats,
        )
        self._num_preemptions = 0
        return stats
