"""Which attention backend runs: `auto` picks Triton on CUDA and the torch path elsewhere; a
named backend is checked against the device and what is installed."""

from __future__ import annotations

import os

import torch

from kernels.backend import AttentionBackend
from kernels.torch_backend import CompiledPagedAttention, TorchPagedAttention
from kernels.triton_backend import TritonPagedAttention

BACKENDS = ("auto", "torch", "compiled", "triton")


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None: they can, on CUDA or on the CPU
    through Triton's interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "attention_backend='triton' needs the triton package: pip install 'conveyor[gpu]'"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"attention_backend='triton' runs on CUDA devices; on {device.type} it needs Triton's "
            "interpreter: set TRITON_INTERPRET=1 before starting (slow, for testing), or use "
            "attention_backend='torch'"
        )
    return None


def triton_available(device: torch.device) -> bool:
    return triton_problem(device) is None


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if name == "compiled":
        if device.type != "cpu":
            raise ValueError("attention_backend='compiled' is for the CPU; on CUDA use 'triton'")
        return CompiledPagedAttention()
    if problem := triton_problem(device):
        raise ValueError(problem)
    return TritonPagedAttention()
