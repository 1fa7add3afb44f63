#!/usr/bin/env bash
# CI's image job (.ci/run calls it after the tests; needs root). No base image can be pulled, so:
#   1. a base from Debian's own packages: debootstrap (minbase, python3, python3-venv), imported into buildah;
#   2. the Dockerfile built with buildah on that base (PYTHON_IMAGE by digest), from a package index on
#      127.0.0.1 (scripts/image_index.py) when the Dockerfile's indexes cannot be reached from the build;
#   3. the image run as the dev overlay's router, prefill and decode pods in network namespaces
#      (scripts/image_job.py): probes, one HTTP and one gRPC request with a NIXL pull, SIGTERM drains.
# Prints the build time, the image size, the pods SERVING, the request and pull lines and a drain table.
# Everything it makes is removed at the end (PDSERVE_IMAGE_KEEP=1 keeps the two images).
set -euo pipefail
cd "$(dirname "$0")/.."

work=${PDSERVE_IMAGE_WORK:-/var/tmp/pdserve-image-check}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm  # the suite of the upstream default base (python:3.11-slim-bookworm): Python 3.11, as CI's
image=localhost/pdserve:ci
base=localhost/pdserve-base:$suite
job_started=$(date +%s)
say() { printf '== image: %s\n' "$*"; }
since() { echo $(( $(date +%s) - $1 )); }

index_pid=""
cleanup() {
    [[ -n $index_pid ]] && kill "$index_pid" 2>/dev/null || true
    if [[ ${PDSERVE_IMAGE_KEEP:-0} != 1 ]]; then
        buildah rmi "$image" "$base" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# ---- tools: buildah builds, runc runs (crun refuses this machine's hybrid cgroup v1/v2 layout) ----------
missing=()
for pair in buildah:buildah debootstrap:debootstrap runc:runc nft:nftables ip:iproute2; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    say "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The pods' clients and the manifests' renderer are the project's own: its venv's Python (.ci/run's).
python3 -c 'import grpc, openai, yaml, pdserve' 2>/dev/null \
    || { echo "image_check.sh: run it from the project's venv (pip install -e '.[test]')" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"

# ---- 1. the base, from Debian's packages -------------------------------------------------------------
started=$(date +%s)
if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$work/rootfs" \
        "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -40 "$work/debootstrap.log"; exit 1
fi
container=$(buildah from scratch)
mountpoint=$(buildah mount "$container")
tar -C "$work/rootfs" -cf - . | tar -C "$mountpoint" -xf -
buildah umount "$container" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 "$container"
buildah commit -q --rm "$container" "$base" >/dev/null
python_version=$(chroot "$work/rootfs" python3 --version)
rm -rf "$work/rootfs"
base_digest=$(buildah images --digests --format '{{.Digest}}' "$base")
say "base: Debian $suite minbase + $python_version, $(buildah images --format '{{.Size}}' "$base")," \
    "$(since "$started") s; PYTHON_IMAGE=$base@$base_digest"

# ---- 2. the build -------------------------------------------------------------------------------------
build_args=(--build-arg "PYTHON_IMAGE=$base@$base_digest")
torch_index=$(sed -n 's/^ARG TORCH_INDEX_URL=//p' Dockerfile)
pypi_index=$(sed -n 's/^ARG PIP_INDEX_URL=//p' Dockerfile)
# Reachable as the build sees it: pip inside the build trusts only its own CA bundle (certifi).
reachable() {
    python3 - "$1" <<'EOF' 2>/dev/null
import ssl, sys, urllib.request
from pip._vendor import certifi
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10,
                       context=ssl.create_default_context(cafile=certifi.where()))
EOF
}
if reachable "$torch_index" && reachable "$pypi_index"; then
    say "indexes: the Dockerfile's own ($torch_index, $pypi_index)"
else
    started=$(date +%s)
    python3 scripts/image_index.py --dest "$work/index" >"$work/index.out" 2>"$work/index.err" &
    index_pid=$!
    until [[ -s $work/index.out ]]; do
        kill -0 "$index_pid" 2>/dev/null || { cat "$work/index.err"; exit 1; }
        sleep 1
    done
    index_url=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["url"])' <"$work/index.out")
    say "indexes: $torch_index or $pypi_index unreachable from the build; serving $index_url:" \
        "$(python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["files"], "files,", d["torch"], "from", d["from"])' \
        <"$work/index.out") ($(since "$started") s)"
    build_args+=(--build-arg "TORCH_INDEX_URL=$index_url" --build-arg "PIP_INDEX_URL=$index_url")
fi
started=$(date +%s)
say "building $image (log: buildah's steps below, full log on failure)"
if ! buildah build --runtime runc --network host "${build_args[@]}" -t "$image" . >"$work/build.log" 2>&1; then
    tail -60 "$work/build.log"; exit 1
fi
grep -E '^\[[0-9]/[0-9]\] STEP' "$work/build.log" | cut -c1-110 | sed 's/^/    /'
say "build time: $(since "$started") s"
say "image size: $(buildah images --format '{{.Size}}' "$image") ($(buildah inspect --type image \
    --format '{{len .OCIv1.RootFS.DiffIDs}}' "$image") layers)"

# ---- 3. the pods --------------------------------------------------------------------------------------
python3 scripts/image_job.py --image "$image"
say "job time: $(since "$job_started") s"
