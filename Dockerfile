# syntax=docker/dockerfile:1
#
# The shardmesh image: one image for every service (`shardmesh coordinator|worker|gateway|generate ...`).
#
#   docker build -t shardmesh:cpu .                                  # CPU (the default target)
#   docker build -t shardmesh:cuda --target cuda .                   # CUDA (NCCL), see below
#   docker build -t shardmesh:cuda --target cuda \
#       --build-arg TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#
# Both targets share one Python base and differ only in the torch wheel. The CUDA wheels from
# download.pytorch.org carry their own CUDA runtime, cuDNN and NCCL (as pip packages), so the image
# needs no nvidia/cuda base: only the host's NVIDIA driver, which the NVIDIA Container Toolkit mounts
# into the container when compose reserves a GPU (`deploy.resources.reservations.devices`) or
# `docker run --gpus` asks for one. Pick the index (cu126, cu128, cu130, ...) that has a
# torch==${TORCH_VERSION} wheel and that the host driver supports (`nvidia-smi` shows the highest
# CUDA version the driver takes).
#
# torch is installed first, from its own index, so that `pip install .` finds the requirement
# (torch>=2.5,<2.14) already met and never pulls the default (CUDA) wheel from PyPI into the CPU image.
# The compose files in compose/ build these targets; see compose/README.md.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- base: Python, an unprivileged user, the health-check helper -------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 shardmesh \
    && useradd --system --uid 10001 --gid shardmesh --create-home --home-dir /home/shardmesh \
        --shell /usr/sbin/nologin shardmesh
# `shardmesh-healthcheck HOST:PORT [--alive]`: one grpc.health.v1 Check (see compose/healthcheck.py).
COPY --chmod=0755 compose/healthcheck.py /usr/local/bin/shardmesh-healthcheck

# ---- torch: the CPU wheel or a CUDA wheel -------------------------------------------------------------
FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX_URL}"

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX_URL}"
# The driver libraries (libcuda, NVML) the NVIDIA Container Toolkit should mount in.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---- the project, on top of either torch --------------------------------------------------------------
FROM torch-cuda AS cuda
WORKDIR /opt/shardmesh/src
COPY pyproject.toml README.md ./
COPY shardmesh ./shardmesh
COPY shardworker ./shardworker
COPY coordinator ./coordinator
COPY gateway ./gateway
COPY shardmesh_cli ./shardmesh_cli
RUN pip install . && shardmesh --help >/dev/null
USER 10001:10001
WORKDIR /home/shardmesh
# gateway, coordinator, worker (the ports compose/ uses; every one is a flag)
EXPOSE 50050 50051 50061 8000
ENTRYPOINT ["shardmesh"]
CMD ["--help"]

# The last stage is the default target: the CPU image.
FROM torch-cpu AS cpu
WORKDIR /opt/shardmesh/src
COPY pyproject.toml README.md ./
COPY shardmesh ./shardmesh
COPY shardworker ./shardworker
COPY coordinator ./coordinator
COPY gateway ./gateway
COPY shardmesh_cli ./shardmesh_cli
RUN pip install . && shardmesh --help >/dev/null
USER 10001:10001
WORKDIR /home/shardmesh
EXPOSE 50050 50051 50061 8000
ENTRYPOINT ["shardmesh"]
CMD ["--help"]
