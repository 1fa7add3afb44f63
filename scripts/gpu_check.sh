#!/usr/bin/env bash
# The device checks for a machine with a CUDA GPU (its own python3 with torch, transformers, safetensors):
# the engine's greedy parity with transformers on the GPU, and offline throughput there.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_model_hf_parity.py -k "cuda" 2>&1 | tail -15 | tee "$out/parity.txt"
timeout 200 python3 benchmarks/bench_throughput.py --device cuda --runs 3 2>&1 | tee "$out/throughput.txt"
