# pdserve service image: one image runs every tier (`pdserve router|prefill|decode|up`).
#   CPU:  docker build -t pdserve:0.1.0 .
#   GPU:  docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#           -t pdserve:0.1.0-cuda .
# torch is installed first, pinned, from PyTorch's own index: its CPU index serves the CPU-only
# wheel (a plain PyPI torch is the CUDA build, gigabytes larger). The project's own
# dependency `torch>=2.4` is then already satisfied and pip leaves it alone.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/opt/pdserve/torch_extensions

# g++ builds the paged decode kernel (shared/engine/model/csrc); without it the engine falls back to a
# slower gather + SDPA decode attention.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN python -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/pdserve
COPY pyproject.toml ./
COPY proto/ proto/
COPY shared/ shared/
COPY prefill_svc/ prefill_svc/
COPY decode_svc/ decode_svc/
COPY router/ router/
COPY colocated_svc/ colocated_svc/
COPY pdserve/ pdserve/
RUN python -m pip install . \
    && python -c "import torch, grpc, pdserve; print('torch', torch.__version__)" \
    && python -c "from shared.engine.model.paged_decode import paged_decode_available as built; assert built()"

# The same uid the Kubernetes manifests run as (runAsUser: 10001).
RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pdserve \
    && chown -R 10001:10001 /opt/pdserve/torch_extensions  # torch takes a lock file there at load
USER 10001:10001
WORKDIR /home/pdserve

# router 50051, prefill 50061, decode 50071 (gRPC); Prometheus metrics on 9400.
EXPOSE 50051 50061 50071 9400
ENTRYPOINT ["pdserve"]
CMD ["--help"]
