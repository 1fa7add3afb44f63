#!/usr/bin/env bash
# The GPU check, one run of at most 8 minutes on the H200 machine (DEVELOPERS.md says how to call it):
#   wheels    install the carried wheels (.whl/, from scripts/fetch_gpu_wheels.sh) into /tmp/site
#   env       GPU, driver, torch, NIXL
#   gpu_step  benchmarks/bench_gpu_step.py --preset llama3-8b: decode-step and prefill timings
#   kv        benchmarks/bench_kv_push_pull.py --device cuda: READ vs WRITE of 8B handoff sizes
#   serving   benchmarks/serving_sweep.py: split (router + prefill + decode, all on the one GPU) and
#             colocated, 8B preset in bf16, rate 4; TTFT p50 / TPOT p50 of both
#   tests     pytest -m gpu (CUDA-only tests: kernels, NIXL VRAM between two processes)
# Each stage has its own time limit (cut to what is left of the whole run's), continues after a
# failure, and writes into $OUT (default /tmp/gpu-check), flat, 7 files: gpu_check.json (every
# stage's status, the figures, and each figure against issue 15's target), env.txt, tests.log,
# gpu_step.json, kv_push_pull.json, serving.json, logs.txt (each stage's and service's log tail).
# All of them are rewritten after every stage, so a run cut short returns what it measured.
#
#   bash scripts/gpu_check.sh            on the GPU machine
#   bash scripts/gpu_check.sh --dry-run  anywhere: the same plumbing on the CPU, tiny preset, small sizes
#   GPU_CHECK_STAGES="wheels env kv" bash scripts/gpu_check.sh   only those stages (the others: skipped)
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
script="$repo/scripts/gpu_check.sh"
export OUT="${OUT:-/tmp/gpu-check}"
python="${PYTHON:-python3}"
total_s="${GPU_CHECK_TOTAL_S:-470}"  # the run tool allows 600 s; room is kept for the machine's start
stages="${GPU_CHECK_STAGES:-wheels env tests gpu_step kv serving}"  # a rerun can take fewer

# Each stage runs as `gpu_check.sh --stage NAME` under timeout(1), which kills its whole process group.
[[ "${1:-}" == "--dry-run" ]] && export GPU_CHECK_MODE=dry-run
mode="${GPU_CHECK_MODE:-gpu}"
if [[ "$mode" == dry-run ]]; then
  device=cpu preset=tiny dtype=float32
  gpu_step_args=(--device cpu --quick --warmups 1 --repeats 3)
  kv_args=(--device cpu --tokens 16 64 --layers 2 --repeats 2)
  workload=(--num-requests 6 --input-len 32 --output-len 8)
  pod_extra="--num-blocks 512"
else
  device=cuda preset=llama3-8b dtype=bfloat16
  gpu_step_args=(--device cuda)
  kv_args=(--device cuda --repeats 10)
  workload=(--num-requests 40 --input-len 128 --output-len 64)
  pod_extra=""
fi
if [[ "$mode" == gpu ]]; then
  export PYTHONPATH="/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}"

# ---- the stages (each writes its log to stdout; $WORK holds scratch files) ----------------------
stage_wheels() {
  ls .whl/*.whl > /dev/null || { echo "no wheels in .whl/ (scripts/fetch_gpu_wheels.sh)"; return 1; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$python" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
for name in ("triton", "nixl_cu13", "nixl_cu12", "grpc", "google.protobuf"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"), getattr(module, "__file__", ""))
    except ImportError as exc:
        print(name, "missing:", exc)
EOF
}

stage_tests() {
  # Only the files that use the marker: collecting the rest would import test-only packages the
  # machine lacks (openai, cryptography, kubernetes-validate), and a collection error stops pytest.
  local files
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
  (( ${#files[@]} )) || { echo "no test file uses pytest.mark.gpu"; return 1; }
  "$python" -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rs "${files[@]}"
}

stage_gpu_step() {
  [[ -f benchmarks/bench_gpu_step.py ]] || { echo "benchmarks/bench_gpu_step.py is not in this tree"; return 1; }
  # shellcheck disable=SC2086  # GPU_STEP_ARGS holds several flags
  "$python" benchmarks/bench_gpu_step.py --preset "$preset" "${gpu_step_args[@]}" ${GPU_STEP_ARGS:-} \
    --json "$OUT/gpu_step.json"
}

stage_kv() {
  # UCX_PROTO_INFO: UCX prints the transport each transfer uses (cuda_ipc, or a tcp fallback) into the log.
  UCX_PROTO_INFO=y "$python" -m benchmarks.bench_kv_push_pull "${kv_args[@]}" --json "$OUT/kv_push_pull.json"
}

stage_serving() {
  # Each run's report lands in $WORK/serving as it ends; the summary gathers them into $OUT/serving.json.
  "$python" benchmarks/serving_sweep.py --systems split,colocated --rates 4 "${workload[@]}" \
    --model "$preset" --pod-args "--device $device --dtype $dtype $pod_extra ${GPU_POD_ARGS:-}" --start-timeout-s 150 \
    --request-timeout-s 60 --no-plots --out-dir "$WORK/serving"
}

if [[ "${1:-}" == "--stage" ]]; then
  "stage_$2"
  exit $?
fi

# ---- the run ---------------------------------------------------------------------------------------
mkdir -p "$OUT"
WORK=$(mktemp -d)
export WORK
started=$(date +%s)

# stage NAME LIMIT_S: run stage_NAME under the smaller of its limit and the time left; log in $WORK.
stage() {
  local name="$1" limit="$2"
  local left=$(( total_s - ($(date +%s) - started) - 15 ))  # 15 s kept for the summary
  (( limit > left )) && limit=$left
  local t0 rc ms
  t0=$(date +%s%N)
  if [[ " $stages " != *" $name "* ]]; then
    echo "not in GPU_CHECK_STAGES" > "$WORK/$name.log"
    rc=200
  elif (( limit < 10 )); then
    echo "no time left for $name" > "$WORK/$name.log"
    rc=200
  else
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=15 "$limit" bash "$script" --stage "$name" > "$WORK/$name.log" 2>&1
    rc=$?
  fi
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $(( ms / 1000 )) $(( ms % 1000 )) >> "$WORK/stages.tsv"
  echo "   exit $rc"
  save_results --quiet
}

# Copy the logs into $OUT and write gpu_check.json from what the stages left so far: after every stage,
# so a run cut short (the run tool's own limit) still returns every figure measured before.
save_results() {
  [[ -f "$WORK/env.log" ]] && cp "$WORK/env.log" "$OUT/env.txt"
  [[ -f "$WORK/tests.log" ]] && cp "$WORK/tests.log" "$OUT/tests.log"
  {
    for name in wheels gpu_step kv serving tests; do  # (the kv log's UCX tables are summed up in gpu_check.json)
      [[ -f "$WORK/$name.log" ]] || continue
      echo "===== $name (last 60 lines)"
      tail -n 60 "$WORK/$name.log"
    done
    for log in "$WORK"/serving/logs/*/*.log; do
      [[ -f "$log" ]] || continue
      echo "===== service ${log#"$WORK"/serving/logs/} (last 30 lines)"
      tail -n 30 "$log"
    done
  } > "$OUT/logs.txt" 2>&1
  "$python" scripts/gpu_check_summary.py --stages "$WORK/stages.tsv" --tests-log "$OUT/tests.log" \
    --kv-log "$WORK/kv.log" --serving-dir "$WORK/serving" --out "$OUT" --mode "$mode" "$@"
}

echo "gpu_check ($mode): results in $OUT"
# The figures first (the issue's targets), then the tests: a slow stage cuts the last ones short.
[[ "$mode" == gpu ]] && stage wheels 60
stage env 45
stage gpu_step 120
stage kv 90
stage serving 240
stage tests 150
save_results
rm -rf "$WORK"
