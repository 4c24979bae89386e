# syntax=docker/dockerfile:1
# Three images from one file:
#   api         the REST API and `conveyor migrate`: Python without torch
#   worker      a GPU worker on a CUDA build of PyTorch
#   worker-cpu  the same worker on a CPU build of PyTorch (docker-compose.cpu.yml)

ARG PYTHON_IMAGE=python:3.11-slim
# the torch the tests run; PyPI's build of it is for CUDA 13 (NVIDIA driver R580 or newer), so
# the GPU worker takes PyTorch's CUDA 12.6 build, which R535-R570 drivers (most H100 hosts) run
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu126

# ---- api -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS api
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CONVEYOR_DATA_DIR=/data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY deploy/api_requirements.py deploy/
RUN python deploy/api_requirements.py > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY conveyor conveyor
COPY api api
COPY ledger ledger
COPY worker worker
COPY migrations migrations
COPY engine engine
COPY kernels kernels
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 conveyor \
    && mkdir -p /data && chown conveyor /data
USER conveyor
EXPOSE 8000
CMD ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---- worker (CUDA) -------------------------------------------------------------------------
# The CUDA runtime comes inside torch's and Triton's wheels and the driver from the host (the
# NVIDIA container toolkit): a plain Python image suffices. Triton compiles a small C module
# when it first launches: gcc and libc's headers (Python.h is in the image already).
FROM ${PYTHON_IMAGE} AS worker
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models CONVEYOR_GPU_LOCK_DIR=/locks \
    TRITON_CACHE_DIR=/models/triton TORCHINDUCTOR_CACHE_DIR=/models/inductor
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX}"
COPY . .
# torch is installed: pip keeps it, and `[gpu]` adds the Triton it was built with
RUN pip install '.[gpu]' \
    && useradd --create-home --uid 10001 conveyor \
    && mkdir -p /models /locks && chown conveyor /models /locks
USER conveyor
# a GPU worker that sees no GPU refuses to start, rather than running on the CPU
CMD ["conveyor", "worker", "--device", "cuda"]

# ---- worker (CPU) --------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS worker-cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models
WORKDIR /app
# a C++ compiler: inductor's compiled norms, rope and decode, and the bfloat16 attention kernel,
# are built on the worker's own CPU at start (without one the worker runs the eager path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN pip install . \
    && useradd --create-home --uid 10001 conveyor \
    && mkdir -p /models && chown conveyor /models
USER conveyor
CMD ["conveyor", "worker", "--device", "cpu"]
