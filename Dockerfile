# syntax=docker/dockerfile:1
# Three images from one file:
#   api         the REST API and `conveyor migrate`: Python without torch
#   worker      a GPU worker on a CUDA build of PyTorch
#   worker-cpu  the same worker on a CPU build of PyTorch (docker-compose.cpu.yml)

ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_CUDA_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

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
FROM ${TORCH_CUDA_IMAGE} AS worker
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models CONVEYOR_GPU_LOCK_DIR=/locks
WORKDIR /app
COPY . .
# the base image's torch satisfies `torch>=2.4`, so pip keeps it
RUN pip install '.[gpu]' \
    && useradd --create-home --uid 10001 conveyor \
    && mkdir -p /models /locks && chown conveyor /models /locks
USER conveyor
CMD ["conveyor", "worker"]

# ---- worker (CPU) --------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS worker-cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models
WORKDIR /app
# a C++ compiler: inductor's compiled norms, rope and decode, and the bfloat16 attention kernel,
# are built on the worker's own CPU at start (without one the worker runs the eager path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN pip install . \
    && useradd --create-home --uid 10001 conveyor \
    && mkdir -p /models && chown conveyor /models
USER conveyor
CMD ["conveyor", "worker", "--device", "cpu"]
