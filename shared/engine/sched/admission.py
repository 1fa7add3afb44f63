"""The scheduler's waiting pass: which waiting requests (new, resumed, or whose remote KV landed)
are admitted this step, with their prefix-cache hits, connector-matched tokens and first chunk."""
from __future__ import annotations

from collections import deque

from shared.engine.kv_cache.manager import KVCacheManager
from shared.engine.kv_transfer.connector import KVConnectorBase
from shared.engine.request import Request, RequestStatus
from shared.engine.sched.output import NewRequestData
from shared.engine.sched.remote_kv import RemoteKvTracker
from shared.engine.sched.step_plan import StepPlan
from shared.engine.sched_config import SchedulerConfig
from shared.engine.structured_output import StructuredOutputManager


class WaitingAdmission:
    """Part of Scheduler (its base): the state below is the Scheduler's, and _commit is its
    bookkeeping shared with the running pass."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    connector: KVConnectorBase | None
    remote_kv: RemoteKvTracker
    structured_output_manager: StructuredOutputManager
    max_num_running_reqs: int
    waiting: deque[Request]
    running: list[Request]

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests (new, resumed, or whose remote KV landed) in arrival order."""
        waiting = self.waiting
        skipped: list[Request] = []
        # Once a request did not fit, only requests that already hold their blocks (their remote KV
        # landed) may pass it: they need few or no new blocks, and running them frees theirs. Stopping
        # there instead wedged a decode pod for good: a preempted request at the head needed the blocks
        # that landed pulls behind it held, so nothing ran and nothing was freed (issue 26, run 2).
        is_blocked = False
        while waiting and plan.token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = waiting[0]
            if not self._is_ready(request) or (is_blocked and not self.kv_cache_manager.has_blocks(request.request_id)):
                skipped.append(waiting.popleft())
                continue
            admitted = self._admit(plan, request)
            if admitted is None:
                is_blocked = True  # first-come order holds for every request that would take new blocks
                skipped.append(waiting.popleft())
                continue
            waiting.popleft()
            if not admitted:
                skipped.append(request)  # its KV is loading
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _is_ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now (the waiting pass steps over it if not)."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self.remote_kv.promote(request):
            return False
        # Stale output still to deliver (resuming now would resample those positions), or a
        # grammar still compiling.
        if request.num_stale_output_tokens and not request.drop_stale_output:
            return False
        return self.structured_output_manager.is_ready(request)

    def _admit(self, plan: StepPlan, request: Request) -> bool | None:
        """Give one waiting request its blocks: True when it runs this step, False when it waits for
        its KV to load, None when it does not fit (the waiting pass stops there)."""
        kv = self.kv_cache_manager
        threshold = self.scheduler_config.long_prefill_token_threshold
        req_id = request.request_id
        if kv.has_blocks(req_id):  # its remote KV landed
            hit_blocks, num_local, num_external, load_async = None, 0, 0, False
            num_computed = request.num_computed_tokens
        else:
            hit_blocks, num_local, num_external, load_async = self._find_computed_tokens(request)
            num_computed = num_local + num_external
        encoder_indices = None
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
            if num_new > plan.token_budget:
                if not self.scheduler_config.enable_chunked_prefill:
                    return None
                num_new = plan.token_budget
            if request.mm_positions:
                num_new, encoder_indices = plan.encoder_budget.schedule(request, num_computed, num_new)
            if num_new <= 0:
                return None
        new_block_ids = kv.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=num_local,
            new_computed_blocks=hit_blocks,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async,
        )
        if new_block_ids is None:
            return None
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, kv.get_block_ids(req_id), num_external)
        if load_async:
            self.remote_kv.start_load(request, num_computed)
            return False
        self._start_running(plan, request, num_computed)
        self._commit(plan, request, num_computed, num_new, encoder_indices, 0)
        return True

    def _start_running(self, plan: StepPlan, request: Request, num_computed: int) -> None:
        """A newly admitted request joins the running list; the runner learns all of it."""
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        plan.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                prefill_token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
                num_prior_output_tokens=request.num_prior_output_tokens,
                structured_output_request=request.structured_output_request,
            )
        )

    def _find_computed_tokens(self, request: Request) -> tuple[list | None, int, int, bool]:
        """(prefix-cache hit blocks, the tokens they hold, tokens the connector can add beyond them,
        whether those load asynchronously)."""
        hit_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        if self.connector is None:
            return hit_blocks, num_local, 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        return hit_blocks, num_local, num_external or 0, load_async
