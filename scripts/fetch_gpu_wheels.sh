#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the cp312 x86-64 wheels the GPU machine lacks, for
# scripts/gpu_check.sh to install there (the machine has no network; `run` carries .whl).
# The image has torch, numpy, grpcio, protobuf, jinja2, tokenizers, safetensors, prometheus-client,
# aiohttp, anyio, h11, click, typing-extensions, zipp (/work/.library/device/KINDS.md). grpcio and
# protobuf travel anyway: the committed stubs refuse an older runtime than the one that made them.
# Versions come from constraints.txt (each pinned once); nixl-cu13 takes nixl-cu12's version.
# nixl-cu13 is slimmed to its UCX backend (scripts/slim_nixl_wheel.py): 59 MB -> about 12 MB.
#   bash scripts/fetch_gpu_wheels.sh        (about 24 MiB in all; the tree that travels must stay < 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
dest=.whl
budget_mib=50

packages=(
  grpcio protobuf grpcio-health-checking grpcio-reflection
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  googleapis-common-protos
  starlette uvicorn httptools llguidance
)

pinned_version() {  # NAME -> its version in constraints.txt (pip normalises - and _ alike)
  local name="$1" line
  line=$(grep -i -E "^${name//-/[-_]}==" constraints.txt || true)
  [[ -n "$line" ]] || { echo "no pin for $name in constraints.txt" >&2; return 1; }
  echo "${line#*==}"
}

download() {  # DIR NAME==VERSION...: cp312 (or abi3) wheels for x86-64 glibc 2.31+ (pip matches each tag exactly)
  local into="$1" && shift
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$into" "$@" 2> >(grep -v "is ignored" >&2)
}

rm -rf "$dest" && mkdir -p "$dest"
specs=()
for name in "${packages[@]}"; do
  specs+=("$name==$(pinned_version "$name")")
done
download "$dest" "${specs[@]}"

nixl_version=$(pinned_version nixl-cu12)
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
download "$raw" "nixl-cu13==$nixl_version"
for wheel in "$raw"/nixl_cu13-*.whl; do
  "$python" scripts/slim_nixl_wheel.py "$wheel" "$dest/$(basename "$wheel")"
done

ls -l "$dest"
total_mib=$(du -sm "$dest" | cut -f1)
tracked_mib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%d", $1 / 1048576 + 0.5}')
echo "wheels: ${total_mib} MiB in $dest; tracked tree: ${tracked_mib} MiB; the run limit is 64 MiB in all"
if (( total_mib > budget_mib )); then
  echo "wheels exceed the ${budget_mib} MiB budget" >&2
  exit 1
fi
