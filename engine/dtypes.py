"""Which dtype the engine computes in: `auto` is the checkpoint's dtype on CUDA (a float32 one,
or one whose config names no dtype, computes in bfloat16, or float16 on a GPU without bfloat16:
float32 would leave the tensor cores idle), bfloat16 on a CPU whose bfloat16 matrix products are
fast (AMX or AVX512-BF16 instructions: several times float32's rate), and float32 on any other
CPU."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@functools.cache
def cpu_has_fast_bfloat16() -> bool:
    """True where the CPU multiplies bfloat16 matrices in hardware (AMX or AVX512-BF16)."""
    cpu = torch.cpu
    for check in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(cpu, check, None)
        if probe is not None and probe():
            return True
    try:  # older torch: the kernel's own word
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_has_bfloat16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8  # Ampere and later


def resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            if checkpoint_dtype != torch.float32:
                return checkpoint_dtype
            half = torch.bfloat16 if cuda_has_bfloat16(device) else torch.float16
            log.info("dtype auto: a float32 checkpoint computes in %s on %s (--dtype float32 "
                     "keeps float32)", str(half).removeprefix("torch."), device)  # fmt: skip
            return half
        return torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32
    if dtype not in NAMES:
        raise ValueError(f"dtype must be auto or one of {', '.join(NAMES)}, got {dtype!r}")
    return NAMES[dtype]
