"""LLMEngine: one scheduler, one model runner and an optional KV connector, stepped synchronously
(schedule -> execute -> update_from_output), plus an offline generate() API.

step() touches nothing outside the engine: the serving loop wraps it in a thread of its own.

    engine = LLMEngine("tiny", SchedulerConfig(), CacheConfig(num_blocks=512))
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))   # out.token_ids, out.finish_reason
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.kv_cache.manager import KVCacheUsage
from shared.engine.kv_transfer.connector import KVConnectorBase
from shared.engine.model.loader import LoadedModel, load_model
from shared.engine.model.runner import ModelRunner
from shared.engine.grammar import Grammar, GrammarCompiler
from shared.engine.request import (
    FinishReason, Request, RequestStatus, SamplingParams, StructuredOutputSpec, TokenLogprobs,
)
from shared.engine.structured_output import StructuredOutputRequest
from shared.engine.sched.output import EngineCoreOutput
from shared.engine.sched.scheduler import Scheduler


@dataclass
class GenerationOutput:
    """One finished request of generate()."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason | None
    text: str | None = None  # decoded output when the model has a tokenizer
    # One per prompt token (None for the first: nothing before it predicts it), when asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked for


@dataclass
class EngineCounters:
    """Totals since the engine started, from the scheduler's per-step stats."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0  # tokens the model computed (prompt chunks, decodes, drafts)
    num_preemptions: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Steps that computed tokens and their wall time: with the tokens, the pod's speed (capacity planning).
    num_compute_steps: int = 0
    busy_s: float = 0.0

    def add(self, num_scheduled_tokens: int, stats, step_s: float = 0.0) -> None:
        self.num_steps += 1
        if num_scheduled_tokens:
            self.num_compute_steps += 1
            self.busy_s += step_s
        self.num_scheduled_tokens += num_scheduled_tokens
        if stats is None:
            return
        self.num_preemptions += stats.num_preemptions
        if stats.prefix_cache_stats is not None:
            self.num_prefix_queried_tokens += stats.prefix_cache_stats.num_queried_tokens
            self.num_prefix_hit_tokens += stats.prefix_cache_stats.num_hit_tokens
        if stats.spec_decoding_stats is not None:
            self.num_draft_tokens += stats.spec_decoding_stats.num_draft_tokens
            self.num_accepted_tokens += stats.spec_decoding_stats.num_accepted_tokens


# Steps computing fewer tokens than this run on one torch thread: on a few busy cores (the engine
# shares them with the gRPC threads), waking more threads for a tiny step costs more than it saves.
# Serving sweep, colocated, rate 4: TPOT p50 10.3 -> 6.8 ms; all at once: 1,390 -> 1,493 tok/s.
SMALL_STEP_TOKENS = 16


def _check_pool_holds_model_len(max_model_len: int, cache_config: CacheConfig) -> None:
    """A request of max_model_len tokens must fit the KV pool on its own; otherwise a long enough
    request would wait forever for blocks that can never be free at once."""
    pool_tokens = (cache_config.num_blocks - 1) * cache_config.block_size  # block 0 is reserved
    if max_model_len > pool_tokens:
        needed = -(-max_model_len // cache_config.block_size) + 1
        raise ValueError(
            f"max_model_len {max_model_len} does not fit the KV pool: {cache_config.num_blocks} blocks of "
            f"{cache_config.block_size} tokens hold {pool_tokens} tokens (one block is reserved); "
            f"use at least {needed} blocks or a max_model_len of at most {pool_tokens}"
        )


class LLMEngine:
    def __init__(self, model: LoadedModel | str | Path, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, connector: KVConnectorBase | None = None, *,
                 dtype: str | None = None, seed: int = 0, num_threads: int | None = None,
                 ngram_min: int = 1, ngram_max: int = 3, device: str = "cpu", cuda_graphs: bool | None = None):
        """model: a LoadedModel, a built-in preset name ("tiny", "100m") or an HF model directory.
        dtype: "float32", "bfloat16" or "auto"/None (the checkpoint's dtype on a GPU, float32 on the CPU).
        seed: the built-in random weights' seed and the source of unseeded requests' seeds.
        num_threads: torch intra-op threads (None leaves torch's setting alone).
        device: where the model and the KV pool live ("cpu", "cuda", "cuda:1").
        cuda_graphs: decode steps replayed as CUDA graphs (ModelRunner's option; None: on for CUDA only).
        scheduler_config.max_model_len is capped at the model's max_position_embeddings; ValueError when
        the KV pool cannot hold a request of that length."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._max_threads = torch.get_num_threads()
        self._threads = self._max_threads
        if scheduler_config.async_scheduling:
            raise ValueError("LLMEngine steps synchronously; async_scheduling is not supported here")
        if scheduler_config.num_speculative_tokens and scheduler_config.speculative_method != "ngram":
            raise ValueError(
                f"speculative_method must be 'ngram' (the only proposer), got {scheduler_config.speculative_method!r}"
            )
        if not isinstance(model, LoadedModel):
            model = load_model(model, dtype=dtype, seed=seed, device=device)
        self.loaded = model
        self.loaded.model.to(device)
        self.loaded.model.pack_weights()
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        if scheduler_config.max_model_len > self.model_config.max_position_embeddings:
            # The model's positions are a hard limit; the scheduler's setting is an upper bound.
            scheduler_config = dataclasses.replace(
                scheduler_config, max_model_len=self.model_config.max_position_embeddings
            )
        _check_pool_holds_model_len(scheduler_config.max_model_len, cache_config)
        self.generation = self.loaded.generation
        self.eos_token_ids = self.generation.eos_token_ids  # any of them ends a request
        self.eos_token_id: int | None = self.generation.eos_token_id  # the primary one
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.connector = connector
        self.scheduler = Scheduler(scheduler_config, cache_config, connector=connector,
                                   eos_token_id=self.eos_token_id, log_stats=True)
        self.runner = ModelRunner(
            self.loaded, num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
            num_speculative_tokens=scheduler_config.num_speculative_tokens,
            ngram_min=ngram_min, ngram_max=ngram_max, connector=connector,
            max_model_len=scheduler_config.max_model_len, seed=seed, device=device,
            eos_token_ids=tuple(self.eos_token_ids), cuda_graphs=cuda_graphs,
        )
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self.last_stats = None  # SchedulerStats of the latest step
        self.counters = EngineCounters()
        self._request_counter = itertools.count()

    # ---- online API (called from one thread) --------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError for token ids outside the vocabulary or a prompt too long. The
        sampling fields the request left unset take the checkpoint's generation_config.json defaults."""
        vocab = self.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        bad = [t for t, _ in request.sampling_params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"request {request.request_id!r}: logit_bias names token ids {bad[:5]} outside the "
                             f"vocabulary [0, {vocab})")
        room = self.scheduler_config.max_model_len - len(request.prompt_token_ids)
        request.sampling_params = self.generation.fill(request.sampling_params, room)
        request.max_tokens = request.sampling_params.max_tokens
        if len(self.eos_token_ids) > 1:
            request.add_eos_token_ids(self.eos_token_ids[1:])
        spec = request.sampling_params.structured_output
        if spec is not None and request.structured_output_request is None:
            request.structured_output_request = StructuredOutputRequest(self._grammar_for(request, spec))
        self.scheduler.add_request(request)

    def _grammar_for(self, request: Request, spec: StructuredOutputSpec) -> Grammar:
        """The request's grammar, advanced over the output an earlier engine generated (a continued request)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer (tokenizer.json in the model directory)")
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        grammar = self._grammar_compiler.compile(spec)
        prior = request.prompt_token_ids[len(request.prompt_token_ids) - request.num_prior_output_tokens:]
        if prior and not grammar.accept_tokens(request.request_id, prior):
            raise ValueError(f"request {request.request_id!r}: the tokens already generated break the structured "
                             f"output constraint: {grammar.error}")
        return grammar

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if self.connector is not None:
            # The abort may land after the step that finished the request and left its blocks held
            # for a peer: nobody will pull them now, so the hold ends here, not at the lease's end.
            self.connector.request_aborted(request_id)

    def step(self) -> list[EngineCoreOutput]:
        """One schedule -> execute -> update round; the per-request outputs it produced."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self._use_threads(1 if scheduler_output.total_num_scheduled_tokens < SMALL_STEP_TOKENS else self._max_threads)
        runner_output = self.runner.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_stats = core_outputs.scheduler_stats
        self.counters.add(scheduler_output.total_num_scheduled_tokens, self.last_stats, time.perf_counter() - started)
        return core_outputs.outputs

    def _use_threads(self, num_threads: int) -> None:
        if num_threads != self._threads:
            torch.set_num_threads(num_threads)
            self._threads = num_threads

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def progress_kv_while_idle(self) -> None:
        """The engine loop's call while nothing is scheduled and no KV work is pending."""
        if self.connector is not None:
            self.connector.progress_while_idle()

    def has_pending_kv_work(self) -> bool:
        """Steps are still needed without unfinished requests: runner state to drop, blocks held for a
        peer's pull, or connector transfers and notifications to drive."""
        if self.scheduler.has_finished_requests() or self.scheduler.num_held_requests:
            return True
        return self.connector is not None and self.connector.has_pending_work()

    def kv_usage(self) -> KVCacheUsage:
        return self.scheduler.get_kv_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.kv_usage().num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_usage().num_total_blocks

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- offline API ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | str],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Run prompts (token ids, or text when the model has a tokenizer) to completion; outputs in
        prompt order. Without sampling_params, the checkpoint's generation_config.json defaults apply."""
        if sampling_params is None:
            sampling_params = self.generation.sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        results: dict[str, GenerationOutput] = {}
        order = []
        for prompt, params in zip(prompts, sampling_params):
            token_ids = self.encode(prompt)
            request_id = f"generate-{next(self._request_counter)}"
            self.add_request(Request(request_id, token_ids, params, eos_token_id=self.eos_token_id))
            results[request_id] = GenerationOutput(request_id, token_ids, [], None)
            if params.prompt_logprobs is not None:
                results[request_id].prompt_logprobs = [None]
            if params.logprobs is not None:
                results[request_id].logprobs = []
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                if out.new_prompt_logprobs and result.prompt_logprobs is not None:
                    result.prompt_logprobs.extend(out.new_prompt_logprobs)
                if out.new_logprobs and result.logprobs is not None:
                    result.logprobs.extend(out.new_logprobs)
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.stop_reason = out.stop_reason
                    pending.discard(out.request_id)
        for result in results.values():
            result.text = self.decode(result.token_ids)
        return [results[request_id] for request_id in order]

    def encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a model with tokenizer.json; pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)
