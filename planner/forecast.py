"""Demand forecast: Holt's linear smoothing (an EWMA of the level plus an EWMA of its trend),
extrapolated over the time a new pod needs to start. Every forecast carries its own explanation."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Forecast:
    level: float  # smoothed current rate
    trend_per_s: float  # smoothed change of the rate per second
    horizon_s: float
    value: float  # max(level, level + trend * horizon): a falling trend never forecasts below now

    def explain(self, unit: str) -> str:
        return (f"level {self.level:.1f} {unit}, trend {self.trend_per_s:+.2f} {unit}/s over "
                f"{self.horizon_s:.0f} s -> {self.value:.1f} {unit}")


class HoltForecaster:
    """Level and trend smoothed with time constants of `window_s` (trend: twice that, it is noisier)."""

    def __init__(self, window_s: float, horizon_s: float) -> None:
        if not window_s > 0 or horizon_s < 0:
            raise ValueError(f"window_s must be > 0 and horizon_s >= 0, got {window_s}, {horizon_s}")
        self.window_s = window_s
        self.horizon_s = horizon_s
        self.level: float | None = None
        self.trend_per_s = 0.0

    def update(self, rate: float, interval_s: float) -> Forecast:
        if self.level is None:
            self.level = rate
        else:
            alpha = 1.0 - math.exp(-interval_s / self.window_s)
            beta = 1.0 - math.exp(-interval_s / (2 * self.window_s))
            previous = self.level
            self.level = alpha * rate + (1 - alpha) * (self.level + self.trend_per_s * interval_s)
            self.trend_per_s = beta * (self.level - previous) / interval_s + (1 - beta) * self.trend_per_s
        # Scaling down on a projected fall would cut pods the present load still needs.
        value = max(self.level, self.level + self.trend_per_s * self.horizon_s, 0.0)
        return Forecast(self.level, self.trend_per_s, self.horizon_s, value)
