"""pdserve and vLLM side by side in one run, same checkpoint, prompts, dtype and threads:
offline (64 x (128 -> 64) greedy, ignore_eos, through each engine's own offline API, each in a
process of its own) and serving (`pdserve colocated` and `vllm serve`, 128 requests 128/64 +-50% all
at once, driven by the same OpenAI-API client: pdserve bench's openai backend).

    python benchmarks/bench_vs_vllm.py --model /path/to/SmolLM2-135M-Instruct \\
        --vllm-python /work/cache/vllm-venv/bin/python [--modes offline serving] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_side import DEFAULT_VLLM_PYTHON, vllm_env, vllm_server_command  # noqa: E402

# The offline run in either engine: prompts from bench_throughput's seeded RNG, tok/s of each timed
# run on stdout as JSON. {engine} is pdserve or vllm.
OFFLINE_CHILD = r"""
import json, random, sys, time
sys.path.insert(0, {repo!r}); sys.path.insert(0, {repo!r} + "/benchmarks")
model, dtype, threads, runs, engine = {model!r}, {dtype!r}, {threads}, {runs}, {engine!r}
N, P, O = 64, 128, 64


def prompts(vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(P)] for _ in range(N)]


def runner():
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=model, dtype=dtype, max_model_len=P + O + 16, max_num_seqs=N, max_num_batched_tokens=8192,
                  seed=0, enable_prefix_caching=False)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params = SamplingParams(max_tokens=O, ignore_eos=True, temperature=0.0)
        return lambda seed: sum(len(o.outputs[0].token_ids) for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts(vocab, seed)], params, use_tqdm=False))
    from bench_throughput import offline_engine
    from shared.engine.request import SamplingParams
    eng = offline_engine(model, dtype, threads)
    params = SamplingParams(max_tokens=O, ignore_eos=True, temperature=0.0)
    return lambda seed: sum(len(o.token_ids) for o in eng.generate(prompts(eng.model_config.vocab_size, seed), params))


if __name__ == "__main__":  # vLLM starts its engine core by spawn, which imports this file again
    run = runner()
    run(10_000)
    rates = []
    for r in range(runs):
        start = time.perf_counter(); n = run(r); rates.append(n / (time.perf_counter() - start))
        assert n == N * O, n
    print("RESULT " + json.dumps(rates), flush=True)
"""


def offline(engine: str, python: str, args: argparse.Namespace) -> list[float]:
    code = OFFLINE_CHILD.format(repo=str(REPO), model=args.model, dtype=args.dtype, threads=args.threads,
                                runs=args.runs, engine=engine)
    env = vllm_env(args.threads) if engine == "vllm" else dict(os.environ)
    script = Path(tempfile.mkdtemp(prefix="bench_vs_vllm_")) / f"offline_{engine}.py"
    script.write_text(code)
    done = subprocess.run([python, str(script)], capture_output=True, text=True, env=env, cwd=str(script.parent))
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} offline failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def start_server(engine: str, python: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    from pdserve.launcher import HOST, free_port

    port = free_port()
    if engine == "vllm":
        cmd = vllm_server_command(python, args.model, HOST, port, args.dtype, 512, "m")
        env = vllm_env(args.threads)
    else:
        cmd = [python, "-m", "colocated_svc", "--host", HOST, "--port", str(free_port()), "--http-port", str(port),
               "--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.threads),
               "--served-model-name", "m", "--max-model-len", "512"]
        env = dict(os.environ)
    process = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    return process, f"http://{HOST}:{port}/v1"


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 600.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s} s: {log.read_text()[-3000:]}")


async def drive(url: str, seed: int) -> dict:
    from pdserve.bench import WorkloadConfig, run_benchmark

    # A full unmeasured run first (its own connections), then the measured one.
    await run_benchmark(url, WorkloadConfig(seed=seed + 1), backend="openai", progress=False, label="warm-up",
                        request_timeout_s=600.0, connection={"model": "m"})
    return await run_benchmark(url, WorkloadConfig(seed=seed), backend="openai", progress=False, label="serve",
                               request_timeout_s=600.0, connection={"model": "m"})


def serving(engine: str, python: str, args: argparse.Namespace) -> dict:
    log = Path(f"/tmp/bench_vs_vllm_{engine}_{os.getpid()}.log")
    process, url = start_server(engine, python, args, log)
    try:
        wait_ready(process, url, log)
        report = asyncio.run(drive(url, 0))
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if report["num_failed"]:
        raise RuntimeError(f"{engine}: {report['num_failed']} requests failed")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory both engines load")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of vLLM's venv")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="offline timed runs per engine (median)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times")
    parser.add_argument("--modes", nargs="+", default=["offline", "serving"], choices=["offline", "serving"])
    args = parser.parse_args()
    pythons = {"pdserve": sys.executable, "vllm": args.vllm_python}
    print(f"model {args.model}, {args.dtype}, {args.threads} threads, {os.cpu_count()} CPUs", flush=True)
    results: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for mode in args.modes:
            for engine in ("pdserve", "vllm"):
                load = os.getloadavg()[0]
                if mode == "offline":
                    rates = offline(engine, pythons[engine], args)
                    figure = sorted(rates)[len(rates) // 2]
                    detail = ", ".join(f"{r:,.0f}" for r in rates)
                else:
                    report = serving(engine, pythons[engine], args)
                    figure = report["output_throughput"]
                    detail = f"TTFT p50 {report['ttft_ms']['p50']:.0f} ms, TPOT p50 {report['tpot_ms']['p50']:.1f} ms"
                results.setdefault(f"{mode} {engine}", []).append(figure)
                print(f"  round {round_ + 1} {mode} {engine}: {figure:,.0f} output tok/s ({detail}; "
                      f"load average before {load:.2f})", flush=True)
    for mode in args.modes:
        ours, theirs = results[f"{mode} pdserve"], results[f"{mode} vllm"]
        best = max(o / t for o, t in zip(ours, theirs))
        print(f"{mode}: pdserve {', '.join(f'{x:,.0f}' for x in ours)} vs vLLM {', '.join(f'{x:,.0f}' for x in theirs)} "
              f"output tok/s; ratio per round {', '.join(f'{o / t:.2f}' for o, t in zip(ours, theirs))} (best {best:.2f})")


if __name__ == "__main__":
    main()
