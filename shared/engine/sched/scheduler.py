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
The update half (update_from_output and the connector's report) lives in shared/engine/sched/update.py.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.kv_cache.manager import KVCacheManager, KVCacheUsage
from shared.engine.kv_transfer.connector import KVConnectorBase, KVLoadFailurePolicy
from shared.engine.request import Request, RequestStatus
from shared.engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from shared.engine.sched.stats import SchedulerStats, SpecDecodingStats
from shared.engine.sched.update import SchedulerUpdateMixin
from shared.engine.structured_output import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler(SchedulerUpdateMixin):
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
        kv_load_failure_policy: KVLoadFailurePolicy | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.connector = connector
        self.eos_token_id = eos_token_id
        self.log_stats = log_stats
        self.structured_output_manager = structured_output_manager or StructuredOutputManager()
        if kv_load_failure_policy is None:
            # Default: the connector's own policy (either attribute name), else recompute.
            kv_load_failure_policy = (
                getattr(connector, "load_failure_policy", None)
                or getattr(connector, "failure_policy", None)
                or KVLoadFailurePolicy.RECOMPUTE
            )
        self.kv_load_failure_policy = KVLoadFailurePolicy(kv_load_failure_policy)

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

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished / preempted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        # Remote KV landed for these (WAITING_FOR_REMOTE_KVS requests become schedulable).
        self._finished_recving: set[str] = set()
        # Finished producer requests whose blocks a peer still reads (freed on finished_sending).
        self._held: dict[str, Request] = {}
        # Aborted while their KV load was in flight: blocks freed when the load reports done.
        self._abandoned_loads: dict[str, Request] = {}
        self._num_preemptions = 0

    # ---- properties ---------------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        """True when a finished request hands its KV to a peer (kv_producer, kv_both): then a
        preempted request's stale in-flight output is dropped instead of delivered."""
        return self.connector is not None and self.connector.role.requires_kv_delivery

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._held:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
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
        return len(self._held)

    def get_kv_usage(self) -> KVCacheUsage:
        """Pool usage for metrics; num_held_blocks counts blocks kept for a peer's pull."""
        usage = self.kv_cache_manager.get_usage()
        held = sum(self.kv_cache_manager.get_num_blocks(req_id) for req_id in self._held)
        return KVCacheUsage(
            num_total_blocks=usage.num_total_blocks,
            num_free_blocks=usage.num_free_blocks,
            num_used_blocks=usage.num_used_blocks,
            num_cached_blocks=usage.num_cached_blocks,
            num_held_blocks=held,
        )

    # ---- schedule -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_scheduled_tokens
        encoder_budget = self.max_num_encoder_input_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        is_async = self.is_async
        allocate = self.kv_cache_manager.allocate_slots
        now = time.monotonic()

        num_scheduled_tokens: dict[str, int] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        encoder_inputs: dict[str, list[int]] = {}
        cached_ids: list[str] = []
        cached_new_blocks: list[list[int] | None] = []
        cached_computed: list[int] = []
        preempted_now = False

        # Running requests first, in arrival order; the tail is preempted under KV pressure.
        running = self.running
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            if request.num_in_flight_samples and (
                request.num_output_tokens + request.num_in_flight_samples >= request.max_tokens
                or request.num_tokens + request.num_in_flight_samples >= max_model_len
            ):
                # Everything it may still emit is already in flight.
                index += 1
                continue
            num_computed = request.num_computed_tokens
            num_new = request.num_tokens_with_spec + request.num_output_placeholders - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if num_new > max_model_len - num_computed:
                num_new = max_model_len - num_computed
            scheduled_encoder = None
            if request.mm_positions and num_new > 0:
                num_new, scheduled_encoder, encoder_budget = self._schedule_encoder_inputs(
                    request, num_computed, num_new, encoder_budget
                )
            if num_new <= 0:
                index += 1
                continue
            while True:
                new_block_ids = allocate(request, num_new)
                if new_block_ids is not None:
                    break
                victim = running.pop()
                self._preempt_request(victim, now)
                preempted_now = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            req_id = request.request_id
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            cached_ids.append(req_id)
            cached_new_blocks.append(new_block_ids or None)
            cached_computed.append(num_computed)
            num_spec = 0
            if request.spec_token_ids:
                num_spec = num_new + num_computed - request.num_tokens - request.num_output_placeholders
                if num_spec > 0:
                    spec_decode_tokens[req_id] = request.spec_token_ids[:num_spec]
                else:
                    num_spec = 0
                request.spec_token_ids = []
            if scheduled_encoder:
                encoder_inputs[req_id] = scheduled_encoder
                request.encoder_inputs_done.update(scheduled_encoder)
            request.num_computed_tokens = num_computed + num_new
            request.num_in_flight_tokens += num_new
            if is_async:
                self._book_placeholders(request, num_spec)
            index += 1

        new_reqs: list[NewRequestData] = []
        # Waiting requests only when nothing was preempted this step (it would just bounce back).
        if not preempted_now and self.waiting:
            token_budget = self._schedule_waiting(
                token_budget, encoder_budget, now, num_scheduled_tokens, encoder_inputs, new_reqs
            )

        cached = CachedRequestData(
            req_ids=cached_ids,
            new_token_ids=[[] for _ in cached_ids],
            new_block_ids=cached_new_blocks,
            num_computed_tokens=cached_computed,
        )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            num_common_prefix_blocks=[self._num_common_prefix_blocks()],
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids=self._preempted_req_ids,
            structured_output_request_ids=self._structured_output_ids(num_scheduled_tokens),
        )
        self.finished_req_ids = set()
        self._preempted_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _schedule_waiting(
        self,
        token_budget: int,
        encoder_budget: int,
        now: float,
        num_scheduled_tokens: dict[str, int],
        encoder_inputs: dict[str, list[int]],
        new_reqs: list[NewRequestData],
    ) -> int:
        """Admit waiting requests (new, resumed, or whose remote KV landed) in arrival order."""
        kv = self.kv_cache_manager
        connector = self.connector
        threshold = self.scheduler_config.long_prefill_token_threshold
        chunked = self.scheduler_config.enable_chunked_prefill
        waiting = self.waiting
        running = self.running
        skipped: list[Request] = []
        while waiting and token_budget > 0 and len(running) < self.max_num_running_reqs:
            request = waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._promote_remote_kv(request):
                skipped.append(waiting.popleft())
                continue
            if (request.num_stale_output_tokens and not request.drop_stale_output) or not (
                self.structured_output_manager.is_ready(request)
            ):
                # Stale output still to deliver (resuming now would resample those positions),
                # or a grammar still compiling.
                skipped.append(waiting.popleft())
                continue
            req_id = request.request_id
            hit_blocks = None
            num_local = num_external = 0
            load_async = False
            if not kv.has_blocks(req_id):
                hit_blocks, num_local = kv.get_computed_blocks(request)
                if connector is not None:
                    matched, load_async = connector.get_num_new_matched_tokens(request, num_local)
                    num_external = matched or 0
                num_computed = num_local + num_external
            else:
                num_computed = request.num_computed_tokens
            if load_async and num_external > 0:
                num_new = 0
            else:
                load_async = False
                num_new = request.num_tokens - num_computed
                if num_new <= 0:
                    # The last token is always computed here so that the step samples.
                    num_external -= 1 - num_new
                    num_computed = request.num_tokens - 1
                    num_new = 1
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > token_budget:
                    if not chunked:
                        break
                    num_new = token_budget
                scheduled_encoder = None
                if request.mm_positions:
                    num_new, scheduled_encoder, encoder_budget = self._schedule_encoder_inputs(
                        request, num_computed, num_new, encoder_budget
                    )
                if num_new <= 0:
                    break
            new_block_ids = kv.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_local,
                new_computed_blocks=hit_blocks,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_async,
            )
            if new_block_ids is None:
                break
            waiting.popleft()
            if connector is not None:
                connector.update_state_after_alloc(request, kv.get_block_ids(req_id), num_external)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_pending_computed_tokens = num_computed
                skipped.append(request)
                continue
            running.append(request)
            request.status = _RUNNING
            new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    prefill_token_ids=list(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(req_id),
                    num_computed_tokens=num_computed,
                )
            )
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            if scheduled_encoder:
                encoder_inputs[req_id] = scheduled_encoder
                request.encoder_inputs_done.update(scheduled_encoder)
            request.num_computed_tokens = num_computed + num_new
            request.num_in_flight_tokens += num_new
            if self.is_async:
                self._book_placeholders(request, 0)
        if skipped:
            waiting.extendleft(reversed(skipped))
        return token_budget

    def _book_placeholders(self, request: Request, num_spec: int) -> None:
        """Async hook: account for the output of a step that has not come back yet."""

    def _schedule_encoder_inputs(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[int, list[int], int]:
        """Multimodal inputs overlapping [num_computed, num_computed + num_new) need their encoder
        run this step; shrink num_new to stop before an input the budget cannot take."""
        scheduled: list[int] = []
        end = num_computed + num_new
        for index, pos in enumerate(request.mm_positions):
            start, length = pos.offset, pos.length
            if start >= end:
                break
            if start + length <= num_computed or index in request.encoder_inputs_done:
                continue
            if self.scheduler_config.disable_chunked_mm_input and num_computed < start and end < start + length:
                num_new = start - num_computed
                break
            if length > encoder_budget:
                num_new = start - num_computed if num_computed < start else 0
                break
            encoder_budget -= length
            scheduled.append(index)
        return num_new, scheduled, encoder_budget

    def _promote_remote_kv(self, request: Request) -> bool:
        """A WAITING_FOR_REMOTE_KVS request whose load finished becomes an ordinary waiting request."""
        req_id = request.request_id
        if req_id not in self._finished_recving:
            return False
        self._finished_recving.discard(req_id)
        num_computed = min(request.num_pending_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING
        return True

    def _num_common_prefix_blocks(self) -> int:
        # Leading blocks of the first running request that every running request shares.
        if not self.running:
            return 0
        num_running = len(self.running)
        blocks = self.kv_cache_manager._blocks.get(self.running[0].request_id, ())
        count = 0
        for block in blocks:
            if block.ref_cnt != num_running:
                break
            count += 1
        return count

    def _structured_output_ids(self, num_scheduled_tokens: dict[str, int]) -> dict[str, int]:
        if not any(r.structured_output_request is not None for r in self.running):
            return {}
        ids = {}
        for req_id in num_scheduled_tokens:
            request = self.requests[req_id]
            if request.structured_output_request is not None:
                ids[req_id] = len(ids)
        return ids

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

    # ---- maintenance --------------------------------------------------------------------------
    def release_held(self, request_ids: Iterable[str] | None = None) -> set[str]:
        """Free blocks held for a peer without waiting for the connector (cancellation, shutdown);
        None releases every hold. Returns the ids released. The connector's own hold record is
        the caller's to drop."""
        ids = list(self._held) if request_ids is None else [r for r in request_ids if r in self._held]
        for req_id in ids:
            self.kv_cache_manager.free(self._held.pop(req_id))
        return set(ids)

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
        usage = self.kv_cache_manager.get_usage()
        num_remote = sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS) if (
            self.connector is not None
        ) else 0
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_for_remote_kv_reqs=num_remote,
            num_held_reqs=len(self._held),
            num_held_blocks=sum(self.kv_cache_manager.get_num_blocks(r) for r in self._held) if self._held else 0,
            kv_cache_usage=usage.usage,
            num_free_blocks=usage.num_free_blocks,
            num_total_blocks=usage.num_total_blocks,
            num_preemptions=self._num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.take_prefix_cache_stats(),
            spec_decoding_stats=spec_decoding_stats,
        )
        self._num_preemptions = 0
        return stats
