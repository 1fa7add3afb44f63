"""SmolLM2-135M-Instruct (the smollm2-135m preset's GGUF) on this machine, pdserve beside vLLM in one run:
offline 64 x (128 -> 64) greedy in float32, bfloat16 and auto; serving from `pdserve up` (colocated and
split) at rate inf and rate 4 through the OpenAI API (pdserve bench --backend openai), and the same against
`vllm serve`. vLLM loads the same weights dequantized to a safetensors folder (its CPU build runs no GGUF),
in the same dtype, on the same threads and prompts. Prints the figures and the issue's targets.

    python benchmarks/bench_smollm2.py [--vllm-python /work/cache/vllm-venv/bin/python] [--num-requests 128]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.launcher import free_port  # noqa: E402
from shared.engine.model.fetched_presets import fetch_preset  # noqa: E402
from vllm_side import DEFAULT_VLLM_PYTHON, vllm_env, vllm_server_command  # noqa: E402

NUM_OFFLINE, PROMPT_LEN, OUTPUT_LEN = 64, 128, 64
VOCAB = 49152

# Offline workers run in a fresh process each (their own thread pool and memory), print one JSON line.
PDSERVE_OFFLINE = """
import json, random, sys, time
sys.path.insert(0, {repo!r})
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
engine = LLMEngine({model!r}, SchedulerConfig(max_num_seqs={n}, max_num_batched_tokens=8192, max_model_len=256),
                   CacheConfig(block_size=16, num_blocks={n} * 13 + 64), dtype={dtype!r})
rng = random.Random(0)
prompts = [[rng.randrange(3, {vocab}) for _ in range({p})] for _ in range({n})]
params = SamplingParams(max_tokens={o}, ignore_eos=True, temperature=0.0)
engine.generate(prompts[:4], params)
start = time.perf_counter(); out = engine.generate(prompts, params); elapsed = time.perf_counter() - start
print(json.dumps({{"tok_s": sum(len(o.token_ids) for o in out) / elapsed, "dtype": engine.model_config.dtype}}))
"""
VLLM_OFFLINE = """
import json, random, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model={model!r}, dtype={dtype!r}, max_model_len=256, seed=0, enable_prefix_caching=True)
rng = random.Random(0)
prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, {vocab}) for _ in range({p})]) for _ in range({n})]
params = SamplingParams(max_tokens={o}, ignore_eos=True, temperature=0.0)
llm.generate(prompts[:4], params, use_tqdm=False)
start = time.perf_counter(); out = llm.generate(prompts, params, use_tqdm=False); elapsed = time.perf_counter() - start
print(json.dumps({{"tok_s": sum(len(o.outputs[0].token_ids) for o in out) / elapsed, "dtype": {dtype!r}}}))
"""


def export_safetensors(gguf: Path, out: Path) -> Path:
    """The GGUF's weights dequantized to float32 safetensors with its tokenizer and chat template (vLLM's input)."""
    if (out / "model.safetensors").is_file():
        return out
    from shared.engine.model.gguf_metadata import GgufMetadata
    from shared.engine.model.loader import load_model, save_pretrained

    loaded = load_model(str(gguf), dtype="float32")
    save_pretrained(loaded, out)
    loaded.tokenizer.save(str(out / "tokenizer.json"))
    metadata = GgufMetadata.open(gguf)
    from shared.engine.gguf_tokenizer import gguf_special_tokens

    config = {**gguf_special_tokens(metadata), "chat_template": metadata.get("tokenizer.chat_template"),
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def offline(python: str, script: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def bench(url: str, rate: str, label: str, args: argparse.Namespace) -> dict:
    out_dir = args.out_dir / "serving"
    command = [sys.executable, "-m", "pdserve.cli", "bench", "--backend", "openai", "--target", url, "--rate", rate,
               "--num-requests", str(args.num_requests), "--input-len", "128", "--output-len", "64",
               "--vocab-size", str(VOCAB), "--seed", "0", "--no-plots", "--out-dir", str(out_dir), "--label", label]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    report = json.loads((out_dir / f"{label}.json").read_text())
    return {"tok_s": report["output_throughput"], "ttft_p50": report["ttft_ms"]["p50"],
            "tpot_p50": report["tpot_ms"]["p50"], "load": report["load_average_before"][0]}


def serve_and_bench(name: str, command: list[str], url: str, args: argparse.Namespace, env=None) -> dict:
    log = open(args.out_dir / f"{name}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                               start_new_session=True)
    try:
        wait_http(url, process)
        return {rate: bench(url, rate, f"{name}-rate{rate}", args) for rate in ("inf", "4")}
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        return {"error": str(exc)}
    finally:
        _stop_group(process)
        log.close()


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group this script started (the server and its pods), SIGKILL after 60 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except ProcessLookupError:
        return  # it has exited already
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def pdserve_up(shape: list[str], name: str, args: argparse.Namespace) -> dict:
    ports = [str(free_port()) for _ in range(4)]
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", "smollm2-135m", "--dtype", args.dtype,
               "--port", ports[0], "--http-port", ports[1], "--prefill-port", ports[2], "--decode-port", ports[3],
               "--log-dir", str(args.out_dir / f"{name}-logs"), *shape]
    return serve_and_bench(name, command, f"http://127.0.0.1:{ports[1]}/v1", args)


def vllm_serve(model_dir: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    command = vllm_server_command(args.vllm_python, str(model_dir), "127.0.0.1", port, args.vllm_dtype, 1024, "smollm2")
    return serve_and_bench("vllm", command, f"http://127.0.0.1:{port}/v1", args, env=vllm_env(os.cpu_count() or 2))


def run_offline(gguf: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    fill = dict(repo=str(REPO), n=NUM_OFFLINE, p=PROMPT_LEN, o=OUTPUT_LEN, vocab=VOCAB)
    results = {}
    for dtype in ("float32", "bfloat16", "auto"):
        results[f"pdserve {dtype}"] = offline(sys.executable, PDSERVE_OFFLINE.format(model=str(gguf), dtype=dtype, **fill))
        print(f"  offline pdserve {dtype}: {results[f'pdserve {dtype}']}", flush=True)
    if args.vllm_python:
        for dtype in ("float32", "bfloat16"):
            script = VLLM_OFFLINE.format(model=str(model_dir), dtype=dtype, **fill)
            results[f"vllm {dtype}"] = offline(args.vllm_python, script, vllm_env(os.cpu_count() or 2))
            print(f"  offline vllm {dtype}: {results[f'vllm {dtype}']}", flush=True)
    return results


def ratio(numerator: dict, denominator: dict, key: str = "tok_s") -> float | None:
    if key in numerator and key in denominator and denominator[key]:
        return numerator[key] / denominator[key]
    return None


def print_summary(offline_results: dict, serving: dict, args: argparse.Namespace) -> None:
    def fmt(value: float | None, unit: str = "x") -> str:
        return "n/a" if value is None else f"{value:.2f}{unit}"

    print(f"\n## offline, {NUM_OFFLINE} x ({PROMPT_LEN} -> {OUTPUT_LEN}) greedy, output tok/s")
    for name, result in offline_results.items():
        print(f"| {name} | {result.get('tok_s', 0):.0f} | {result.get('dtype', result.get('error', ''))} |")
    print(f"\n## serving, {args.num_requests} requests 128/64 (+-50%), OpenAI API, dtype {args.dtype}")
    print("| system | rate | out tok/s | TTFT p50 ms | TPOT p50 ms | load avg |")
    for system, rates in serving.items():
        for rate, r in rates.items():
            if isinstance(r, dict):
                print(f"| {system} | {rate} | {r['tok_s']:.0f} | {r['ttft_p50']:.0f} | {r['tpot_p50']:.1f} | {r['load']:.1f} |")
            else:
                print(f"| {system} | error: {r} |")
    o, s = offline_results, serving
    auto, f32 = o.get("pdserve auto", {}), o.get("pdserve float32", {})
    same = o.get(f"vllm {auto.get('dtype', 'float32')}", {})
    colo, split, vllm = (s.get(k, {}) for k in ("pdserve colocated", "pdserve split", "vllm"))
    print("\n## against the issue's targets")
    print(f"- auto picks {auto.get('dtype')}; auto / float32 offline: {fmt(ratio(auto, f32))} (target >= 1.6x, bfloat16)")
    print(f"- split / colocated, all at once: {fmt(ratio(split.get('inf', {}), colo.get('inf', {})))} (target >= 0.9x); "
          f"TPOT p50 at rate 4: split {fmt(split.get('4', {}).get('tpot_p50'), ' ms')} vs colocated "
          f"{fmt(colo.get('4', {}).get('tpot_p50'), ' ms')} (target: split lower)")
    print(f"- pdserve / vLLM offline at equal dtype ({auto.get('dtype')}): {fmt(ratio(auto, same))} (target >= 1.0x)")
    print(f"- pdserve colocated / vLLM serving, all at once: {fmt(ratio(colo.get('inf', {}), vllm.get('inf', {})))} "
          f"(target >= 1.3x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).is_file() else "",
                        help="the python of a venv with vLLM (empty: pdserve only)")
    parser.add_argument("--dtype", default="auto", help="pdserve up's --dtype for the serving runs")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: offline, serving, "
                        "pdserve-serving")
    parser.add_argument("--out-dir", type=Path, default=Path("out/bench_smollm2"))
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from shared.engine.model.dtype_choice import auto_dtype

    args.vllm_dtype = auto_dtype("quantized", "cpu")[0] if args.dtype == "auto" else args.dtype
    gguf = fetch_preset("smollm2-135m")
    model_dir = export_safetensors(gguf, args.out_dir / "smollm2-f32-safetensors") if args.vllm_python else None
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model {gguf}", flush=True)
    offline_results = {} if "offline" in args.skip else run_offline(gguf, model_dir, args)
    serving = {}
    if "serving" not in args.skip:
        if "pdserve-serving" not in args.skip:
            serving["pdserve colocated"] = pdserve_up(["--colocated"], "pdserve-colocated", args)
            serving["pdserve split"] = pdserve_up([], "pdserve-split", args)
        if args.vllm_python:
            serving["vllm"] = vllm_serve(model_dir, args)
    (args.out_dir / "summary.json").write_text(json.dumps({"offline": offline_results, "serving": serving}, indent=1))
    print_summary(offline_results, serving, args)


if __name__ == "__main__":
    main()
