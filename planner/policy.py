"""The planner's scaling policy: latency targets, replica bounds, hysteresis and cooldown, and the
smoothing windows (one dataclass field per setting; flags are generated from the fields)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.serving.server.settings import setting


@dataclass(frozen=True)
class ScalingPolicy:
    ttft_target_s: float = field(default=2.0, metadata=setting("TTFT p90 target (seconds)", flag="--ttft-target"))
    itl_target_s: float = field(default=0.05, metadata=setting(
        "inter-token latency (TPOT) p90 target (seconds)", flag="--itl-target"))
    min_prefill: int = field(default=1, metadata=setting("fewest prefill pods"))
    max_prefill: int = field(default=8, metadata=setting("most prefill pods"))
    min_decode: int = field(default=1, metadata=setting("fewest decode pods"))
    max_decode: int = field(default=8, metadata=setting("most decode pods"))
    max_pods: int | None = field(default=None, metadata=setting(
        "most pods of both tiers together (unset: only the per-tier bounds)"))
    interval_s: float = field(default=10.0, metadata=setting("seconds between decisions", flag="--interval"))
    forecast_window_s: float = field(default=30.0, metadata=setting(
        "time constant of the demand forecast's level and trend (seconds)", flag="--forecast-window"))
    capacity_window_s: float = field(default=120.0, metadata=setting(
        "how long observations of the pods' speed count in the capacity estimate (seconds)", flag="--capacity-window"))
    horizon_s: float = field(default=30.0, metadata=setting(
        "how far ahead demand is forecast: about a new pod's start time (seconds)", flag="--horizon"))
    scale_down_margin: float = field(default=0.2, metadata=setting(
        "hysteresis: a tier shrinks only when its need fits the smaller count with this share to spare"))
    cooldown_s: float = field(default=60.0, metadata=setting(
        "after a tier's count changes, seconds before it may shrink", flag="--cooldown"))
    itl_margin: float = field(default=0.8, metadata=setting(
        "share of the ITL target a decode step may fill (the rest absorbs batch swings)"))

    def __post_init__(self) -> None:
        for name in ("ttft_target_s", "itl_target_s", "interval_s", "forecast_window_s", "capacity_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.horizon_s < 0 or self.cooldown_s < 0:
            raise ValueError(f"horizon_s and cooldown_s must be >= 0, got {self.horizon_s}, {self.cooldown_s}")
        for tier in ("prefill", "decode"):
            low, high = getattr(self, f"min_{tier}"), getattr(self, f"max_{tier}")
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"need 0 <= min_{tier} <= max_{tier} and max_{tier} >= 1, got {low}, {high}")
        if self.max_pods is not None and self.max_pods < max(self.min_prefill + self.min_decode, 2):
            raise ValueError(f"max_pods must hold min_prefill + min_decode (and at least 2), got {self.max_pods}")
        if not 0 <= self.scale_down_margin < 1 or not 0 < self.itl_margin <= 1:
            raise ValueError(f"need 0 <= scale_down_margin < 1 and 0 < itl_margin <= 1, got "
                             f"{self.scale_down_margin}, {self.itl_margin}")
