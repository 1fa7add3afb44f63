"""The prefill:decode planner: estimates each tier's per-pod capacity online, forecasts demand and
chooses both tiers' replica counts (decision logic pure, in policy/capacity/forecast/decision)."""
