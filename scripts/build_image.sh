#!/usr/bin/env bash
# Builds the pdserve image with docker, podman or buildah (whichever is found first), then, where the
# tool can run containers, checks it the way Kubernetes runs it: read-only root, non-root user, no
# compiler, the prebuilt decode kernel loading.
#   scripts/build_image.sh                 # pdserve:0.1.0, CPU torch
#   scripts/build_image.sh --gpu           # pdserve:0.1.0-cuda, CUDA torch (cu128 index)
#   TAG=registry.example.com/pdserve:0.1.0 scripts/build_image.sh
set -euo pipefail
cd "$(dirname "$0")/.."

gpu=false
[[ "${1:-}" == "--gpu" ]] && gpu=true
build_args=()
if $gpu; then
  tag="${TAG:-pdserve:0.1.0-cuda}"
  build_args+=(--build-arg "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128"
               --build-arg "RUNTIME_C_COMPILER=gcc libc6-dev")  # Triton's kernel launchers
else
  tag="${TAG:-pdserve:0.1.0}"
fi

if command -v docker >/dev/null; then tool=docker
elif command -v podman >/dev/null; then tool=podman
elif command -v buildah >/dev/null; then tool=buildah
else
  echo "build_image.sh: none of docker, podman, buildah is installed" >&2
  exit 1
fi

echo "building $tag with $tool"
if [[ $tool == buildah ]]; then
  buildah build --layers "${build_args[@]}" -t "$tag" .
  echo "built $tag (buildah cannot run it; check it with podman or docker)"
  exit 0
fi
"$tool" build "${build_args[@]}" -t "$tag" .

echo "checking $tag: read-only root, uid 10001, prebuilt kernel"
"$tool" run --rm --read-only --tmpfs /tmp --user 10001:10001 --entrypoint python "$tag" -c '
import logging, time
logging.basicConfig(level=logging.INFO)
import torch
started = time.perf_counter()
from shared.engine.model.paged_decode import paged_decode_available
assert paged_decode_available(), "the paged decode kernel did not load"
print(f"kernel loaded in {time.perf_counter() - started:.2f} s")
'
echo "ok: $tag"
