"""Scheduler test helpers with the spec's parameters: create_scheduler(...) and create_requests(...)."""
from __future__ import annotations

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.kv_transfer.connector import KVRole
from loopback_connector import LoopbackConnector, LoopbackKVStore
from shared.engine.request import PlaceholderRange, Request, SamplingParams
from shared.engine.sched.async_scheduler import AsyncScheduler
from shared.engine.sched.scheduler import Scheduler

EOS_TOKEN_ID = 50256

# What the spec's model names stand for here: (context length, largest multimodal input).
MODELS = {
    "facebook/opt-125m": (2048, None),
    "llava-hf/llava-1.5-7b-hf": (4096, 576),
}


def create_scheduler(
    model: str = "facebook/opt-125m",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool | None = None,
    long_prefill_token_threshold: int = 0,
    disable_chunked_mm_input: bool = False,
    use_kv_connector: bool = False,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
    speculative_method: str | None = None,
    skip_tokenizer_init: bool = False,
    async_scheduling: bool = False,
    use_v2_model_runner: bool = False,
    kv_role: str = "kv_both",
    kv_store: LoopbackKVStore | None = None,
    engine_id: str = "engine-0",
) -> Scheduler:
    """The scheduler under test. enable_prefix_caching None means off (the newer spec helper's
    default: its async tests build equal prompts that must not share blocks); max_model_len
    None means the larger of max_num_batched_tokens and the model's context length;
    use_v2_model_runner and skip_tokenizer_init do not change the scheduler here."""
    context_len, mm_input_tokens = MODELS[model]
    if max_model_len is None:
        max_model_len = max(max_num_batched_tokens, context_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        disable_chunked_mm_input=disable_chunked_mm_input,
        max_mm_input_tokens=mm_input_tokens,
        async_scheduling=async_scheduling,
        num_speculative_tokens=num_speculative_tokens or 0,
        speculative_method=speculative_method if num_speculative_tokens else None,
    )
    cache_config = CacheConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=bool(enable_prefix_caching)
    )
    connector = None
    if use_kv_connector:
        connector = LoopbackConnector(
            KVRole(kv_role), kv_store or LoopbackKVStore(), engine_id=engine_id, block_size=block_size
        )
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(scheduler_config, cache_config, connector=connector, eos_token_id=EOS_TOKEN_ID, log_stats=True)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    mm_positions: list[list[PlaceholderRange]] | None = None,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: list[str] | None = None,
    ignore_eos: bool = False,
    mm_hashes_list: list[list[str]] | None = None,
) -> list[Request]:
    """Requests "0", "1", ... (or req_ids) with prompts [i] * num_tokens ([0] * num_tokens when
    same_prompt). block_size is accepted for the spec's signature: the KV-cache manager hashes blocks."""
    sampling_params = SamplingParams(
        ignore_eos=ignore_eos,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        prompt_logprobs=prompt_logprobs,
    )
    requests = []
    for i in range(num_requests):
        requests.append(
            Request(
                request_id=req_ids[i] if req_ids is not None else f"{i}",
                prompt_token_ids=[0 if same_prompt else i] * num_tokens,
                sampling_params=sampling_params,
                eos_token_id=EOS_TOKEN_ID,
                arrival_time=0,
                mm_positions=mm_positions[i] if mm_positions is not None else None,
                mm_hashes=mm_hashes_list[i] if mm_hashes_list is not None else None,
            )
        )
    return requests
