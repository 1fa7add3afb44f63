"""A serving pod's engine side: the model, its engine with a NIXL connector in the pod's role, the
engine loop thread, admission limits and the load report. Both tiers build one; only the role differs.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.wire import LoadReport, PrefillKvSource
from shared.engine.llm_engine import LLMEngine
from shared.serving.engine_thread import EngineLoop, RequestStream
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy, KVRole
from shared.engine.kv_transfer.handle import KvLayout
from shared.engine.kv_transfer.nixl_connector import NixlConnector
from shared.engine.kv_transfer.transfer_agent import KvTransferAgent
from shared.engine.model.loader import DTYPE_AUTO, load_model
from shared.engine.request import Request


class PodOverloaded(RuntimeError):
    """The pod already has as many requests in flight as it admits."""


@dataclass(frozen=True)
class PodConfig:
    """Engine settings of one pod (validated here; flags map onto these in each service's config)."""

    model: str = "tiny"  # a built-in preset name or an HF model directory
    dtype: str = DTYPE_AUTO  # the checkpoint's dtype on a GPU, float32 on the CPU
    seed: int = 0  # seed of the built-in random weights (prefill and decode must agree)
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    max_requests_in_flight: int = 1024  # beyond this new requests get RESOURCE_EXHAUSTED
    lease_s: float = 30.0  # producer: how long a finished prompt's blocks wait for their pull
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE
    advertise_address: str = ""  # producer: host:port decode pods use to reach this pod
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    device: str = "cpu"  # where the model and the KV pool live: "cpu" or "cuda[:N]" (NIXL then reads VRAM)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_requests_in_flight < 1:
            raise ValueError(f"max_requests_in_flight must be >= 1, got {self.max_requests_in_flight}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


class Pod:
    """Owns the engine and its loop thread. Build it, then start() inside the event loop."""

    def __init__(self, role: KVRole | None, config: PodConfig):
        """role None: a colocated pod (no connector) that runs whole requests itself."""
        self.role = role
        self.config = config
        loaded = load_model(config.model, dtype=config.dtype, seed=config.seed, device=config.device)
        model_config = loaded.config
        max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        # A fresh id per process start: a restarted prefill pod cannot confirm an old hold.
        self.engine_id = f"{role.value if role else 'colocated'}-{uuid.uuid4().hex[:12]}"
        self.layout = KvLayout(
            model_name=f"{config.model}@{config.seed}",
            dtype=model_config.dtype,
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.block_size,
        )
        self.connector = None if role is None else NixlConnector(
            role,
            engine_id=self.engine_id,
            layout=self.layout,
            agent=KvTransferAgent(KvTransferAgent.unique_name(role.value)),
            source_address=config.advertise_address,
            lease_s=config.lease_s,
            failure_policy=config.kv_load_failure_policy,
        )
        self.engine = LLMEngine(
            loaded,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            CacheConfig(
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            connector=self.connector,
            num_threads=config.num_threads,
            device=config.device,
        )
        self.loop = EngineLoop(self.engine)
        if self.connector is not None:
            self.connector.wake = self.loop.wake
        self.tokenizer = loaded.tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_id = self.engine.eos_token_id
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_model_len = max_model_len

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        """Abort what is in flight and free every block, holds for peers included, then stop."""
        if self.connector is not None:
            self.connector.release_all()
        await self.loop.stop()
        if self.connector is not None:
            self.connector.shutdown()

    def check_prompt_fits(self, num_tokens: int) -> None:
        """ValueError unless num_tokens leaves room for at least one more token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens; the model's maximum length is {self.max_model_len}, "
                "which leaves no room for output"
            )

    def submit(self, request: Request) -> RequestStream:
        if self.loop.num_in_flight >= self.config.max_requests_in_flight:
            raise PodOverloaded(
                f"{self.loop.num_in_flight} requests in flight (limit {self.config.max_requests_in_flight})"
            )
        return self.loop.submit(request)

    def load_report(self) -> LoadReport:
        usage = self.engine.kv_usage()
        return LoadReport(
            num_waiting=self.engine.num_waiting,
            num_running=self.engine.num_running,
            num_free_blocks=usage.num_free_blocks,
            num_total_blocks=usage.num_total_blocks,
            num_held_blocks=self.connector.num_held_blocks if self.connector else 0,
            is_overloaded=self.loop.num_in_flight >= self.config.max_requests_in_flight,
        )

    def kv_source(self) -> PrefillKvSource:
        return PrefillKvSource(self.engine_id, self.layout, self.connector.agent.kv_source())
