"""Which dtype the engine computes in: `auto` is the checkpoint's dtype on CUDA (a float32 one,
or one whose config names no dtype, computes in bfloat16, or float16 on a GPU without bfloat16:
float32 would leave the tensor cores idle), bfloat16 on a CPU whose bfloat16 matrix products
outrun its float32 ones (AMX, or AVX512-BF16 on AMD), and float32 on any other CPU, unless a
16-bit checkpoint's weights would fill more than half the memory in float32."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from conveyor.engine.cpu_memory import total_memory_bytes
from conveyor.kernels import cpu_build

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
    """True where the CPU's bfloat16 matrix products outrun its float32 ones: on AMX's tiles,
    or with AVX512-BF16 on AMD (Zen 4 and 5: oneDNN's bfloat16 products 2.2x its float32 rate).
    Intel's AVX512-BF16 alone (Cooper Lake, or a VM that hides AMX) issues its dot product at
    float32's multiply-add rate, and oneDNN's bfloat16 products ran at half its float32 rate
    (168 against 315 GFLOP/s on an Emerald Rapids VM): float32 is the faster of the two there."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if amx is not None and avx512_bf16 is not None:
        has_amx, has_avx512_bf16 = amx(), avx512_bf16()
    else:  # older torch: the kernel's own word
        has_amx, has_avx512_bf16 = cpu_build.cpu_has_amx_bf16(), cpu_build.cpu_has_avx512_bf16()
    return has_amx or (has_avx512_bf16 and cpu_build.cpu_vendor() == "AuthenticAMD")


def cuda_has_bfloat16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8  # Ampere and later


def resolve_dtype(
    dtype: str | torch.dtype,
    checkpoint_dtype: torch.dtype,
    device: torch.device,
    float32_bytes: Callable[[], int] | None = None,
) -> torch.dtype:
    """The dtype to compute in; `float32_bytes`, if given, tells what the checkpoint's weights
    would take in float32 (read only where that decides)."""
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
        return _cpu_auto(checkpoint_dtype, float32_bytes)
    if dtype not in NAMES:
        raise ValueError(f"dtype must be auto or one of {', '.join(NAMES)}, got {dtype!r}")
    return NAMES[dtype]


def _cpu_auto(
    checkpoint_dtype: torch.dtype, float32_bytes: Callable[[], int] | None
) -> torch.dtype:
    if cpu_has_fast_bfloat16():
        return torch.bfloat16
    if checkpoint_dtype in (torch.bfloat16, torch.float16) and float32_bytes is not None:
        # float32 doubles a 16-bit checkpoint's weights: past half the memory, loading would
        # leave too little for the KV cache and the step, or fail
        needed, memory = float32_bytes(), total_memory_bytes()
        if needed > memory // 2:
            log.warning(
                "dtype auto: this CPU computes fastest in float32, but the weights would take "
                "%.1f GiB of %.1f GiB of memory in it; computing in %s (--dtype float32 "
                "forces float32)", needed / 2**30, memory / 2**30,
                str(checkpoint_dtype).removeprefix("torch."),
            )  # fmt: skip
            return checkpoint_dtype
    return torch.float32
