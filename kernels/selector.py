"""Which attention backend runs: `auto` picks the fastest correct one for the device (Triton on
CUDA, the compiled decode on a CPU with a C++ compiler, else the eager torch path, saying why
in a log line); a named backend is checked against the device and what is installed."""

from __future__ import annotations

import logging
import os

import torch

from conveyor.kernels.backend import AttentionBackend
from conveyor.kernels.torch_backend import CompiledPagedAttention, TorchPagedAttention
from conveyor.kernels.triton_backend import TritonPagedAttention

BACKENDS = ("auto", "torch", "compiled", "triton")

log = logging.getLogger(__name__)


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


def _fastest(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton" if triton_available(device) else "torch"
    if device.type != "cpu":
        return "torch"
    from conveyor.kernels import compiled_paged

    if problem := compiled_paged.compiler_missing():
        log.warning("attention: the eager torch path, not the compiled one (%s)", problem)
        return "torch"
    return "compiled"


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = _fastest(device)
    if name == "torch":
        return TorchPagedAttention()
    if name == "compiled":
        if device.type != "cpu":
            raise ValueError("attention_backend='compiled' is for the CPU; on CUDA use 'triton'")
        return CompiledPagedAttention()
    if problem := triton_problem(device):
        raise ValueError(problem)
    return TritonPagedAttention()
