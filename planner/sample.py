"""What the planner observes over one interval: the router's demand and each tier's work, as plain
data (built from Prometheus scrapes by the service, from simulated pods by the benchmark)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierSample:
    """One tier over one interval, summed over its pods (gauges as of the interval's end)."""

    num_pods: int  # pods that answered the scrape
    busy_s: float = 0.0  # engine seconds spent computing steps
    num_steps: int = 0  # engine steps run
    num_tokens: int = 0  # tokens computed (prompt tokens on prefill, output tokens on decode)
    num_waiting: float = 0.0  # requests queued for the engine
    num_running: float = 0.0  # requests being computed
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    latency_p90_s: float | None = None  # prefill: TTFT p90; decode: TPOT (ITL) p90; None: no request ended

    @property
    def mean_batch(self) -> float | None:
        """Tokens per engine step (on a decode pod: the running batch)."""
        return self.num_tokens / self.num_steps if self.num_steps else None

    @property
    def mean_step_s(self) -> float | None:
        return self.busy_s / self.num_steps if self.num_steps else None


@dataclass(frozen=True)
class Sample:
    """One planner interval: the demand that reached the router and what each tier did with it."""

    interval_s: float
    num_arrivals: int  # requests that reached the router
    num_prompt_tokens: int  # their prompt tokens
    num_finished: int  # requests that ended
    num_output_tokens: int  # the output tokens of those that ended
    prefill: TierSample
    decode: TierSample
    ttft_p90_s: float | None = None  # the router's (what clients see); None: no first token sent

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
