"""A serving pod's engine side: the model, its engine with a NIXL connector in the pod's role, the
engine loop thread, admission limits and the load report. Both tiers build one; only the role differs.
"""
from __future__ import annotations

import json
import math
import logging
import uuid
import dataclasses
from dataclasses import dataclass, field

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.wire.payloads import LoadReport, PrefillKvSource
from shared.engine.llm_engine import LLMEngine
from shared.serving.pod.engine_thread import EngineLoop, RequestStream
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handle import KvLayout
from shared.engine.kv_transfer.handle_signing import HandleSigner
from shared.engine.kv_transfer.nixl_connector import NixlConnector
from shared.engine.kv_transfer.nixl_consumer import ConfirmRelease, NixlConsumer
from shared.engine.kv_transfer.nixl_producer import NixlProducer
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent
from shared.engine.model.generation_config import (
    GENERATION_CONFIG_AUTO, OVERRIDABLE_FIELDS, check_generation_config_mode, check_generation_overrides,
)
from shared.engine.model.loader import DTYPE_AUTO, DTYPE_CHOICES, load_model
from shared.engine.request import Request, SamplingParams
from shared.serving.pod.outcomes import InvalidRequest, PodOverloaded, check_context_length
from shared.serving.server.settings import engine_settings, setting, settings_group
from shared.serving.server.tls import TlsConfig

logger = logging.getLogger(__name__)


def serving_scheduler_config() -> SchedulerConfig:
    """The pods' batching limits (the engine's own defaults are sized for offline runs). Its max_model_len
    is the pod's to resolve (PodConfig.max_model_len)."""
    return SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096)


def serving_cache_config() -> CacheConfig:
    """The pods' KV pool."""
    return CacheConfig(block_size=16, num_blocks=4096, enable_prefix_caching=True)


# The retry hint of a refusal. The pod refuses only past a deep queue, which drains in seconds, not steps;
# clients (the openai SDK among them) wait exactly this long, so a shorter hint spends their retries at once.
OVERLOAD_RETRY_AFTER_MS = 1000

# PodConfig fields only one role has a flag for.
PRODUCER_SETTINGS = ("lease_s", "advertise_address")
CONSUMER_SETTINGS = ("kv_load_failure_policy",)


@dataclass(frozen=True)
class PodConfig:
    """Settings of one pod: the engine configs it runs with, and the pod's own. Each field with
    setting() metadata is a command-line flag (shared/serving/server/settings.py)."""

    model: str = field(default="tiny", metadata=setting(
        "built-in preset (tiny, 100m: random weights; smollm2-135m: fetched at first use), an HF model "
        "directory, or a GGUF file (or a directory holding one)"))
    dtype: str = field(default=DTYPE_AUTO, metadata=setting(
        "model and KV dtype; auto: the checkpoint's dtype on a GPU; on the CPU bfloat16 where it has "
        "AVX512-BF16 or AMX and the checkpoint is bfloat16, float16 or quantized, else float32", choices=DTYPE_CHOICES
    ))
    seed: int = field(default=0, metadata=setting(
        "seed of the built-in random weights (prefill and decode must agree)"
    ))
    generation_config: str = field(default=GENERATION_CONFIG_AUTO, metadata=setting(
        "auto: sampling fields a request leaves unset take the model's generation_config.json defaults "
        "(max_new_tokens, temperature, top_p, top_k, repetition_penalty); vllm: ignore them; a folder: take "
        "those of its generation_config.json instead; as vLLM's flag (split: the prefill pod's decides, "
        "decode continues with the params it resolved)"
    ))
    override_generation_config: str = field(default="", metadata=setting(
        "a JSON object merged over those defaults (under vllm: the only ones), in generation_config.json's "
        f"field names ({', '.join(OVERRIDABLE_FIELDS)}), e.g. '{{\"temperature\": 0.5}}'; as vLLM's flag"
    ))
    scheduler: SchedulerConfig = field(default_factory=serving_scheduler_config, metadata=engine_settings(
        max_num_seqs="most requests computed in one step",
        max_num_batched_tokens="most tokens computed in one step",
    ))
    max_model_len: int | None = field(default=None, metadata=setting(
        "longest prompt + output (default: the model's own limit, max_position_embeddings, or as many tokens "
        "as the KV pool holds when that is less; capped at the model's limit)"
    ))
    cache: CacheConfig = field(default_factory=serving_cache_config, metadata=engine_settings(
        block_size="tokens per KV block",
        num_blocks="KV blocks in the pool",
        enable_prefix_caching=setting("turn prefix caching off", flag="--no-prefix-caching"),
    ))
    # Requests beyond the running batch (--max-num-seqs) wait in the scheduler's queue, as in vLLM: a
    # burst is served late rather than refused (clients give up on refusals within their few retries).
    # The bound keeps a flood from growing the queue without end; lower it to refuse overload early
    # (the router then tries another pod; benchmarks/bench_overload.py measures both).
    max_requests_in_flight: int = field(default=1024, metadata=setting(
        "requests in flight (running and queued) beyond which new ones get RESOURCE_EXHAUSTED with a "
        "retry hint"
    ))
    max_queue_time_s: float | None = field(default=None, metadata=setting(
        "seconds a new request may be predicted to wait for its turn (from the queue ahead and the service time "
        "the engine measured) before it gets RESOURCE_EXHAUSTED with a retry hint; a decode pod refuses only "
        "requests with no token out yet, and reports the rest as overload (off when unset)",
        flag="--max-queue-time",
    ))
    lease_s: float = field(default=30.0, metadata=setting(
        "seconds a prompt's KV is held for its pull (prefill)"
    ))
    kv_load_failure_policy: KVLoadFailurePolicy = field(default=KVLoadFailurePolicy.RECOMPUTE, metadata=setting(
        "recompute the prompt locally or fail the request when pulled KV is not known good (decode)"
    ))
    advertise_address: str = field(default="", metadata=setting(
        "host:port decode pods use to reach this pod (prefill; default: the bound host:port)"
    ))
    num_threads: int | None = field(default=None, metadata=setting("torch intra-op threads (default: the container's CPU limit, else torch's)"))
    device: str = field(default="cpu", metadata=setting(
        "where the model and the KV pool live: cpu or cuda[:N] (NIXL then reads device memory)"
    ))
    enforce_eager: bool = field(default=False, metadata=setting(
        "never replay decode steps as CUDA graphs (on cuda they are captured at start-up by default)"
    ))
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=settings_group())
    # Signs and checks KV handles (shared/serving/server/handle_key.py says where it comes from); None: unsigned.
    kv_handle_key: bytes | None = field(default=None, repr=False)

    @property
    def generation_overrides(self) -> dict:
        """override_generation_config parsed (ValueError when it is not a JSON object)."""
        if not self.override_generation_config:
            return {}
        try:
            overrides = json.loads(self.override_generation_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"override_generation_config is not JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ValueError(
                f"override_generation_config must be a JSON object, got {self.override_generation_config!r}")
        return overrides

    def __post_init__(self) -> None:
        check_generation_config_mode(self.generation_config)
        check_generation_overrides(self.generation_overrides)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_requests_in_flight < 1:
            raise ValueError(f"max_requests_in_flight must be >= 1, got {self.max_requests_in_flight}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0, got {self.max_queue_time_s}")


def resolved_max_model_len(config: "PodConfig", model_limit: int) -> int:
    """The pod's model length: the flag's, capped at the model's own limit (max_position_embeddings); unset,
    the model's limit, or what the KV pool holds when that is less (vLLM sizes it alike, from the pool)."""
    if config.max_model_len is not None:
        return min(config.max_model_len, model_limit)
    pool_tokens = (config.cache.num_blocks - 1) * config.cache.block_size  # one block is the pool's null block
    if pool_tokens < model_limit:
        logger.warning("max_model_len %d: the model takes %d tokens, but %d KV blocks of %d tokens hold only "
                       "%d (raise --num-blocks, or set --max-model-len)", pool_tokens, model_limit,
                       config.cache.num_blocks, config.cache.block_size, pool_tokens)
    return min(model_limit, pool_tokens)


class Pod:
    """Owns the engine and its loop thread. Build it, then start() inside the event loop."""

    def __init__(self, role: KVRole | None, config: PodConfig, *, confirm_release: ConfirmRelease | None = None):
        """role None: a colocated pod (no connector) that runs whole requests itself. confirm_release: how a
        decode pod (kv_consumer) confirms each pull's hold with its prefill pod (ReleaseKv)."""
        self.role = role
        self.config = config
        loaded = load_model(config.model, dtype=config.dtype, seed=config.seed, device=config.device,
                            generation_config=config.generation_config,
                            generation_overrides=config.generation_overrides)
        logger.info("sampling defaults (--generation-config %s): %s", config.generation_config,
                    loaded.generation.describe())
        model_config = loaded.config
        max_model_len = resolved_max_model_len(config, model_config.max_position_embeddings)
        # A fresh id per process start: a restarted prefill pod cannot confirm an old hold.
        self.engine_id = f"{role.value if role else 'colocated'}-{uuid.uuid4().hex[:12]}"
        self.layout = KvLayout(
            model_name=f"{config.model}@{config.seed}",
            dtype=model_config.dtype,
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.cache.block_size,
        )
        self.connector = None if role is None else self._make_connector(role, config, confirm_release)
        self.engine = LLMEngine(
            loaded,
            dataclasses.replace(config.scheduler, max_model_len=max_model_len),
            config.cache,
            connector=self.connector,
            num_threads=config.num_threads,
            device=config.device,
            cuda_graphs=False if config.enforce_eager else None,
        )
        self.loop = EngineLoop(self.engine)
        if self.connector is not None:
            self.connector.wake = self.loop.wake
        self.tokenizer = loaded.tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_id = self.engine.eos_token_id
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_model_len = max_model_len

    def _make_connector(self, role: KVRole, config: PodConfig, confirm_release: ConfirmRelease | None) -> NixlConnector:
        if role is KVRole.BOTH:
            raise ValueError("a pod runs as kv_producer or kv_consumer, not kv_both")
        common = dict(
            engine_id=self.engine_id,
            layout=self.layout,
            agent=KvTransferAgent(KvTransferAgent.unique_name(role.value)),
            load_failure_policy=config.kv_load_failure_policy,
            signer=HandleSigner(config.kv_handle_key),
        )
        if role is KVRole.PRODUCER:
            return NixlProducer(source_address=config.advertise_address, lease_s=config.lease_s, **common)
        return NixlConsumer(confirm_release=confirm_release, **common)

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        """Abort what is in flight and free every block, holds for peers included, then stop."""
        if self.connector is not None:
            self.connector.release_all()
        await self.loop.stop()
        if self.connector is not None:
            self.connector.shutdown()

    def fill_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """sampling with the fields it left unset filled from the checkpoint's defaults (max_tokens within
        the room the prompt leaves). Before anything reads max_tokens (the prefill pod's handoff, the decode
        pod's continuation). A decode pod gets them already filled from a prefill pod
        (PrefillResponse.resolved_sampling) and fills only those sent without a prefill."""
        return self.engine.generation.fill(sampling, self.max_model_len - num_prompt_tokens)

    def check_context_length(self, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """At the edge only (the colocated server's Generate; the router for the split): outcomes'
        check_context_length against this pod's model length. Prefill and decode pods do not check again:
        their engine ends a sequence at the model's length."""
        check_context_length(num_prompt_tokens, sampling, self.max_model_len)

    def check_room(self, num_requests: int) -> None:
        """Admits a fan-out (n completions) whole or not at all: InvalidRequest when it could never fit,
        PodOverloaded while the requests in flight leave too little room."""
        limit = self.config.max_requests_in_flight
        if num_requests > limit:
            raise InvalidRequest(f"n is {num_requests}, and this server runs at most {limit} requests at once "
                                 f"(--max-requests-in-flight)")
        if self.loop.num_in_flight + num_requests > limit:
            raise PodOverloaded(f"{self.loop.num_in_flight} requests in flight and n is {num_requests} (limit "
                                f"{limit})", retry_after_ms=OVERLOAD_RETRY_AFTER_MS)

    def submit(self, request: Request) -> RequestStream:
        if self.loop.num_in_flight >= self.config.max_requests_in_flight:
            raise PodOverloaded(
                f"{self.loop.num_in_flight} requests in flight (limit {self.config.max_requests_in_flight})",
                retry_after_ms=OVERLOAD_RETRY_AFTER_MS,
            )
        if request.num_prior_output_tokens == 0:  # a continuation's first token is out: it is queued, not refused
            self._check_queue_time()
        return self.loop.submit(request)

    def predicted_wait_s(self) -> float:
        """How long one more request would wait for its turn here now."""
        return self.loop.wait_predictor.predicted_wait_s(self.loop.num_in_flight)

    def _check_queue_time(self) -> None:
        """PodOverloaded when a new request's predicted wait is past --max-queue-time; the hint is the excess."""
        limit_s = self.config.max_queue_time_s
        if limit_s is None:
            return
        wait_s = self.predicted_wait_s()
        if wait_s > limit_s:
            raise PodOverloaded(f"predicted wait {wait_s:.2f} s for {self.loop.num_in_flight} requests in flight "
                                f"(--max-queue-time {limit_s:g} s)",
                                retry_after_ms=max(1, math.ceil((wait_s - limit_s) * 1000)))

    @property
    def is_overloaded(self) -> bool:
        """Whether a new request would be refused now (load reports say so: the router then picks elsewhere)."""
        if self.loop.num_in_flight >= self.config.max_requests_in_flight:
            return True
        limit_s = self.config.max_queue_time_s
        return limit_s is not None and self.predicted_wait_s() > limit_s

    def load_report(self) -> LoadReport:
        usage = self.engine.kv_usage()
        return LoadReport(
            num_waiting=self.engine.num_waiting,
            num_running=self.engine.num_running,
            num_free_blocks=usage.num_free_blocks,
            num_total_blocks=usage.num_total_blocks,
            num_held_blocks=self.connector.num_held_blocks if self.connector else 0,
            is_overloaded=self.is_overloaded,
            max_model_len=self.max_model_len,
            max_requests_in_flight=self.config.max_requests_in_flight,
        )

    def kv_source(self) -> PrefillKvSource:
        return PrefillKvSource(self.engine_id, self.layout, self.connector.agent.kv_source())
