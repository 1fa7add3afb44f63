"""Where the CPU goes: one offline run (64 x (128 -> 64) greedy) and one colocated serving run (all at
once, OpenAI API) broken into linears, attention, norms and rotary, LM head, sampler, scheduler and the
Python around them, as time and share, in float32 and bfloat16 (step_timers.py wraps the parts).

    python benchmarks/profile_bf16.py --model /path/to/SmolLM2-135M-Instruct --threads 2
    python benchmarks/profile_bf16.py --model tiny --modes offline --dtypes float32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# --repo PATH profiles the engine of another checkout (the code before a change) with these timers.
if "--repo" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--repo") + 1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from bench_throughput import NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN, offline_engine, run_once  # noqa: E402
from step_timers import StepTimers, format_table  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402


def profile_offline(model: str, dtype: str, threads: int, runs: int) -> tuple[dict[str, float], float]:
    """The parts' seconds summed over `runs` timed runs (after a warm-up), and the median tok/s."""
    engine = offline_engine(model, dtype, threads)
    run_once(engine, seed=10_000)  # warm-up: allocator, thread pool, kernel selection
    timers = StepTimers()
    timers.install(LLMEngine)
    rates, parts = [], {}
    try:
        for run in range(runs):
            timers.reset()
            rates.append(run_once(engine, seed=run))
            for label, seconds in timers.snapshot().items():
                parts[label] = parts.get(label, 0.0) + seconds
    finally:
        timers.uninstall()
    return {k: v / runs for k, v in parts.items()}, sorted(rates)[len(rates) // 2]


# ---- serving: the colocated server in a child process that wraps its own engine ----------------


def serve_child(profile_out: str, server_args: list[str]) -> int:
    """Runs `pdserve colocated` with the timers installed; stdin lines 'reset' / 'dump' start a window
    and write its parts as JSON to profile_out."""
    from colocated_svc.__main__ import main as colocated_main

    timers = StepTimers()
    timers.install(LLMEngine)

    def control() -> None:
        for line in sys.stdin:
            if line.strip() == "reset":
                timers.reset(any_thread=True)
            elif line.strip() == "dump":
                Path(profile_out).write_text(json.dumps(timers.snapshot()))

    threading.Thread(target=control, name="profile-control", daemon=True).start()
    return colocated_main(server_args)


async def _drive(http_url: str, seed: int, child: subprocess.Popen) -> float:
    """A full unmeasured run, then the measured one inside a timer window; output tok/s."""
    from pdserve.bench import WorkloadConfig, bench_client, generate_workload, run_workload, warm_up

    # Each run on its own connections: a kept-alive connection the server closed while idle would fail
    # the next run's request with "server disconnected".
    async with bench_client("openai", http_url) as client:
        await run_workload(client, generate_workload(WorkloadConfig(seed=seed + 1)), label="warm-up",
                           request_timeout_s=600.0, progress=False, id_prefix=f"warm-{time.time_ns()}")
    async with bench_client("openai", http_url) as client:
        await warm_up(client, WorkloadConfig(seed=seed), 1, 600.0)
        child.stdin.write(b"reset\n")
        child.stdin.flush()
        records, duration = await run_workload(client, generate_workload(WorkloadConfig(seed=seed)), label="serve",
                                               request_timeout_s=600.0, progress=False,
                                               id_prefix=f"prof-{time.time_ns()}")
        child.stdin.write(b"dump\n")
        child.stdin.flush()
    failed = [r for r in records if not r.is_success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    return sum(r.num_output_tokens for r in records) / duration


def profile_serving(model: str, dtype: str, threads: int, repo: str | None) -> tuple[dict[str, float], float]:
    from pdserve.launcher import HOST, ServiceProcess, free_port, wait_serving

    port, http_port = free_port(), free_port()
    out = Path(tempfile.mkdtemp(prefix="profile_bf16_")) / "parts.json"
    args = ["--host", HOST, "--port", str(port), "--http-port", str(http_port), "--model", model,
            "--dtype", dtype, "--num-threads", str(threads)]
    log = open(out.with_suffix(".log"), "wb")
    own = [] if repo is None else ["--repo", repo]
    process = subprocess.Popen([sys.executable, __file__, "--serve-child", str(out), *own, "--", *args],
                               stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                               cwd=repo or str(Path(__file__).resolve().parent.parent))
    service = ServiceProcess(name="colocated", address=f"{HOST}:{port}", process=process, log_path=out.with_suffix(".log"))
    try:
        wait_serving(service, 300.0)
        rate = asyncio.run(_drive(f"http://{HOST}:{http_port}/v1", 0, process))
        for _ in range(100):
            if out.exists():
                break
            time.sleep(0.05)
        return json.loads(out.read_text()), rate
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-child":
        sys.exit(serve_child(sys.argv[2], sys.argv[sys.argv.index("--") + 1:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory or preset")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["offline", "serving"], choices=["offline", "serving"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="offline timed runs (parts averaged)")
    parser.add_argument("--repo", default=None, help="profile the engine of this checkout instead of this one")
    args = parser.parse_args()
    import shared

    print(f"engine from {Path(shared.__file__).parent.parent}")
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, model {args.model}; offline: "
          f"{NUM_REQUESTS} x ({PROMPT_LEN} -> {OUTPUT_LEN}) greedy; serving: colocated, 128 requests 128/64 "
          f"(+-50%) all at once over the OpenAI API", flush=True)
    columns, rates = {}, []
    for mode in args.modes:
        for dtype in args.dtypes:
            if mode == "offline":
                parts, rate = profile_offline(args.model, dtype, args.threads, args.runs)
            else:
                parts, rate = profile_serving(args.model, dtype, args.threads, args.repo)
            name = f"{mode} {dtype}"
            columns[name] = parts
            rates.append(f"{name}: {rate:,.0f} output tok/s")
            print(f"  {name}: {rate:,.0f} output tok/s (load average {os.getloadavg()[0]:.2f})", flush=True)
    print("\n" + format_table(columns))
    print("\n" + "; ".join(rates))


if __name__ == "__main__":
    main()
