# pdserve service image: one image runs every tier (`pdserve router|prefill|decode|colocated|up`).
# Build it with scripts/build_image.sh (docker, podman or buildah), or directly:
#   CPU:  docker build -t pdserve:0.1.0 .
#   GPU:  docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#           --build-arg RUNTIME_C_COMPILER="gcc libc6-dev" -t pdserve:0.1.0-cuda .
# Two stages: the build stage has the compiler and builds the paged decode kernel into the package (a
# real extension, setup.py); the runtime stage copies the finished virtual environment and has no
# compiler. Dependencies are pinned by constraints.txt; torch by TORCH_VERSION from PyTorch's own index
# (its CPU index serves the CPU-only wheel; a plain PyPI torch is the CUDA build, gigabytes larger).
# PYTHON_IMAGE: any Debian bookworm image with python3 and python3-venv, by digest, so a rebuild gets the
# same base. The default is Docker Hub's python:3.11-slim-bookworm at a digest taken from public Dockerfiles
# that pin it (this project's machines cannot reach Docker Hub to check it); refresh it for a release with
#   skopeo inspect --format '{{.Digest}}' docker://docker.io/library/python:3.11-slim-bookworm
# CI builds on a base made from Debian's own packages instead (scripts/image_check.sh: debootstrap, then
# --build-arg PYTHON_IMAGE=localhost/pdserve-base@sha256:...).
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where pip finds everything else (pip reads PIP_INDEX_URL): PyPI, or a mirror (CI serves a local one).
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# python3: Debian's interpreter has no `python` command (the venv's has).
RUN python3 -m venv /opt/venv
COPY constraints.txt /src/constraints.txt
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install -c /src/constraints.txt setuptools ninja
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY proto/ proto/
COPY shared/ shared/
COPY prefill_svc/ prefill_svc/
COPY decode_svc/ decode_svc/
COPY router/ router/
COPY colocated_svc/ colocated_svc/
COPY pdserve/ pdserve/
COPY planner/ planner/
# --no-build-isolation: setup.py needs this environment's torch to build the kernel against it. The check
# runs from / so that Python imports the installed package (with its .so), not the source tree in /src.
RUN pip wheel --no-build-isolation --no-deps --wheel-dir /wheels . \
    && pip install -c constraints.txt /wheels/pdserve-*.whl \
    && cd / && python -c "from shared.engine.model.kernel_build import prebuilt_library as p; assert p(), 'no prebuilt kernel'"
# Not needed at run time, so not shipped: setuptools and ninja only build the kernel (prebuilt above; the runtime
# stage has no compiler, so torch could not build one there anyway), and nixl-cu12's nixl_ep_cu12 (108 MB) is
# NIXL's expert-parallel extension, which pdserve never imports (it uses nixl_cu12's agent API with UCX).
RUN pip uninstall -y setuptools ninja \
    && rm -r "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nixl_ep_cu12"

FROM ${PYTHON_IMAGE} AS runtime
# GPU images only: Triton compiles a small C launcher for each kernel the first time it runs, so they need a
# C compiler (scripts/build_image.sh --gpu passes "gcc libc6-dev"; still no C++). The CPU image has none.
ARG RUNTIME_C_COMPILER=""
# TRITON_CACHE_DIR: Triton's compiled kernels go under ~/.cache (an emptyDir in the manifests; the root
# filesystem, home included, is read-only).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/pdserve \
    TRITON_CACHE_DIR=/home/pdserve/.cache/triton
RUN if [ -n "$RUNTIME_C_COMPILER" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $RUNTIME_C_COMPILER \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/venv /opt/venv
# The same uid the Kubernetes manifests run as (runAsUser: 10001).
RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve
# No compiler here: the kernel must come prebuilt, and load (this fails the build otherwise).
RUN ! command -v c++ \
    && python -c "import logging; logging.basicConfig(level=logging.INFO); \
from shared.engine.model.paged_decode import paged_decode_available as ok; assert ok()"

# router 50051 (gRPC) and 8000 (OpenAI HTTP API), prefill 50061, decode 50071 (gRPC); Prometheus metrics on
# 9400; the KV transfer (NIXL/UCX TCP) listens on --kv-port-range, 20000-20099 by default.
EXPOSE 8000 50051 50061 50071 9400 20000-20099
ENTRYPOINT ["pdserve"]
CMD ["--help"]
