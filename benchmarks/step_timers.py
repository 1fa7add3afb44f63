"""Explicit timers wrapped around the engine's parts (linears, attention, norms, LM head, sampler,
scheduler, ...), each charged its own time without its children's, so the parts add up to the run.

torch's CPU ops run synchronously on the calling thread, so a wall-clock timer around a call is its
cost; a timer costs about a microsecond, a few thousand per step at most.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict

# The parts, in report order: (label, where it is wrapped). Each wrapper charges the exclusive time
# of its call (children excluded) to its label.
PARTS = (
    ("linears", "Linear.forward: qkv, o, gate_up, down projections"),
    ("attention: decode", "the decode attention (kernel or gather + SDPA)"),
    ("attention: prefill", "fresh-prompt and span attentions (SDPA)"),
    ("attention: KV write + glue", "write_kv, output buffer, row copies"),
    ("norms", "RMSNorm (with the residual add where fused)"),
    ("rotary", "cos/sin lookup and the rotation"),
    ("model: other", "embedding, SiLU*up, residual adds, row selection"),
    ("LM head", "compute_logits"),
    ("sampler", "sample() and logprobs"),
    ("runner: inputs/outputs", "execute_model's own Python: ids, positions, slots, metadata"),
    ("scheduler", "schedule() and update_from_output()"),
    ("engine step: other", "LLMEngine.step's own code"),
    ("between steps", "the wall time outside engine steps"),
)


class StepTimers:
    """Installs the wrappers (process-wide, until uninstall); counts only the thread that calls reset()."""

    def __init__(self):
        self._patches: list[tuple[object, str, object]] = []
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open call: time spent in its wrapped children
        self._thread: int | None = -1  # counts nothing until reset(); None counts every thread
        self._window_start = time.perf_counter()
        self.step_wall = 0.0

    def reset(self, any_thread: bool = False) -> None:
        """Start a new window; only the caller's thread is counted, or every thread with any_thread (a
        server, whose parts all run on its one engine thread)."""
        self.totals.clear()
        self._thread = None if any_thread else threading.get_ident()
        self._window_start = time.perf_counter()

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        timers = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if timers._thread is not None and threading.get_ident() != timers._thread:
                return original(*args, **kwargs)
            timers._stack.append(0.0)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = timers._stack.pop()
                timers.totals[label] += elapsed - children
                if timers._stack:
                    timers._stack[-1] += elapsed
                else:
                    timers.totals["__steps__"] += elapsed

        self._patches.append((owner, name, original))
        setattr(owner, name, timed)

    def install(self, engine_class: type) -> None:
        """Wraps the model's and engine's parts (module functions are wrapped where they are called from)."""
        from shared.engine.model import attention, llama, runner
        from shared.engine.sched import scheduler

        self.wrap(engine_class, "step", "engine step: other")
        self.wrap(scheduler.Scheduler, "schedule", "scheduler")
        self.wrap(scheduler.Scheduler, "update_from_output", "scheduler")
        self.wrap(runner.ModelRunner, "execute_model", "runner: inputs/outputs")
        self.wrap(llama.LlamaModel, "forward", "model: other")
        self.wrap(llama.Linear, "forward", "linears")
        self.wrap(llama, "paged_attention", "attention: KV write + glue")
        self.wrap(llama, "write_kv", "attention: KV write + glue")
        self.wrap(attention, "_decode_attention", "attention: decode")
        self.wrap(attention, "_fresh_prompts_attention", "attention: prefill")
        self.wrap(attention, "_span_attention", "attention: prefill")
        self.wrap(llama.RMSNorm, "forward", "norms")
        self.wrap(llama.RotaryEmbedding, "forward", "rotary")
        self.wrap(llama.LlamaModel, "compute_logits", "LM head")
        # The sampler is called from the runner, or (after the runner's split) from step_outputs.
        try:
            from shared.engine.model import step_outputs
            self.wrap(step_outputs, "sample", "sampler")
            self.wrap(step_outputs.StepSampler, "_output_logprobs", "sampler")
        except ImportError:
            self.wrap(runner, "sample", "sampler")
            self.wrap(runner.ModelRunner, "_output_logprobs", "sampler")
        # The residual add is counted with the norm where the model fuses the two (add_rms_norm); older
        # code calls apply_rope directly, newer code through rotate.
        for name, label in (("add_rms_norm", "norms"), ("rotate", "rotary"), ("apply_rope", "rotary")):
            if hasattr(llama, name):
                self.wrap(llama, name, label)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()

    def snapshot(self) -> dict[str, float]:
        """Seconds per part since reset(), 'between steps' being the window's wall time outside steps."""
        wall = time.perf_counter() - self._window_start
        parts = {label: self.totals.get(label, 0.0) for label, _ in PARTS}
        parts["between steps"] = max(0.0, wall - self.totals.get("__steps__", 0.0))
        return parts


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per part, time (s) and share (%) for each column (a run)."""
    names = list(columns)
    header = "| part | " + " | ".join(f"{n}: s | {n}: %" for n in names) + " |"
    rule = "|---|" + "---:|---:|" * len(names)
    rows = [header, rule]
    totals = {n: sum(columns[n].values()) for n in names}
    for label, _ in PARTS:
        cells = []
        for n in names:
            seconds = columns[n].get(label, 0.0)
            cells.append(f"{seconds:.3f} | {100 * seconds / totals[n]:.1f}" if totals[n] else "0 | 0")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows.append("| total (wall) | " + " | ".join(f"{totals[n]:.3f} | 100" for n in names) + " |")
    return "\n".join(rows)
