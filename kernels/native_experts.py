"""A mixture-of-experts layer's routed experts in one call on x86 CPUs (`routed_experts`): the
(token, expert) pairs sorted by expert, each expert's tokens through its gate/up weight,
SiLU(gate) * up and its down weight, whole experts a thread (or parts of them where there are
few experts for the threads), and each token's outputs weighted and summed
(`csrc/moe_routing.h`); the products in float32 with AVX-512 or AVX2 and FMA
(`csrc/experts_f32.cpp`), in bfloat16 on AMX's tile unit (`csrc/experts_amx.cpp`) or with
AVX512-BF16's dot products (`csrc/experts_bf16.cpp`).

float32 runs on AVX-512's 16 lanes where the CPU has AVX-512 (the same source built for them,
the same results bit for bit; on a 2-core Intel Xeon, a layer of 64 experts 1.0-1.05x the AVX2
build's speed at 1-16 tokens, 1.2x at 128 and 1.5x at 1,024-4,096), else on AVX2's 8. On a
2-core AVX2 CPU (AMD EPYC) with 8 experts of 64 a token: a layer in 0.26-0.42x
the time of torch's grouped products at 16-128 tokens and ~0.5x at 256-4,096, so it runs every
step; on a 2-core AMD EPYC with AVX-512 (whose grouped products are oneDNN's AVX-512 ones),
0.16x, 0.31-0.43x, 0.62x and 0.43-0.47x at 16, 128, 1,024 and 4,096 tokens. bfloat16, on a
2-core CPU with AMX (whose grouped products are oneDNN's, a call per expert and product): 5-8x
faster at 1-128 tokens and ~4x at 4,096. A row's result never depends on the step's other
rows (its sums run in k order whatever its tile), so batch-invariant mode runs the kernels too.

Each kernel reads its own layout of the weights (`layout`), made once at load and read front to
back: float32 in strips of 16 columns, k-major within a strip (`[E, N / 16, K, 16]`); bfloat16
in strips of 32 columns in pairs of k (`[E, N / 32, K / 2, 32, 2]`), the operand of the CPU's
bfloat16 dot product and of AMX's tiles. Nothing else reads them. float32 weights whose every
value is a bfloat16 one (a checkpoint saved in bfloat16, as checkpoints ship, run in float32)
keep float32's strips in bfloat16 (`compact`): the kernel widens each to its float32 value as
it reads it, so its results are the same bit for bit and a step of few tokens, which is the
weights' reads from memory, reads half the bytes.

Built and cached like the other CPU kernels (`kernels.cpu_build`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from conveyor.kernels.cpu_build import load_amx, load_avx512_bf16, load_f32_builds

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = {"avx512": CSRC / "experts_f32.cpp", "avx2": CSRC / "experts_f32.cpp",
           "amx": CSRC / "experts_amx.cpp", "avx512_bf16": CSRC / "experts_bf16.cpp"}  # fmt: skip
# the sizes each kernel takes: hidden and intermediate sizes, multiples of these
_MULTIPLES = {"avx512": (16, 8), "avx2": (16, 8), "avx512_bf16": (32, 32), "amx": (32, 32)}


@functools.cache
def kernels(
    dtype: torch.dtype, weights: torch.dtype | None = None
) -> tuple[tuple[str, Callable[..., None]], ...]:
    """The kernels that run `dtype` here (with weights stored in `weights`, by default
    `dtype`), fastest first: each one's instruction set and function, built and loaded; none
    where none can be built or run here. bfloat16 runs on the tile unit where the CPU has AMX
    and Linux lends it to the process, and on AVX512-BF16's dot products."""
    suffix = "_bf16_weights" if weights not in (None, dtype) else ""
    loaded = []
    for isa, lib in _libraries(dtype):
        fn = getattr(lib, FUNCTIONS[isa] + suffix)
        fn.argtypes, fn.restype = ARGUMENTS[dtype], None
        loaded.append((isa, fn))
    return tuple(loaded)


@functools.cache
def _libraries(dtype: torch.dtype) -> tuple[tuple[str, ctypes.CDLL], ...]:
    """The libraries of `kernels(dtype)` that built and loaded here, fastest first."""
    fallback = "experts run as grouped products"
    found: list[tuple[str, ctypes.CDLL | None]] = []
    if dtype == torch.float32:  # one source: AVX-512's 16 lanes where the CPU has them
        found += load_f32_builds(SOURCES["avx512"], "the experts kernel", fallback)
    elif dtype == torch.bfloat16:
        amx = load_amx(SOURCES["amx"], fallback)
        if amx is not None and not amx.conveyor_amx_ready():
            log.warning("Linux did not lend this process AMX's tile registers: experts use "
                        "AVX512-BF16's dot products")  # fmt: skip
            amx = None
        found.append(("amx", amx))
        found.append(("avx512_bf16", load_avx512_bf16(SOURCES["avx512_bf16"], fallback)))
    return tuple((isa, lib) for isa, lib in found if lib is not None)


def kernel(dtype: torch.dtype) -> tuple[str, Callable[..., None]] | None:
    """The fastest of `kernels(dtype)`, or None."""
    found = kernels(dtype)
    return found[0] if found else None


FUNCTIONS = {"avx512": "conveyor_moe_f32", "avx2": "conveyor_moe_f32",
             "avx512_bf16": "conveyor_moe_bf16", "amx": "conveyor_moe_amx"}  # fmt: skip
_P, _I = ctypes.c_void_p, ctypes.c_int64
ARGUMENTS = {  # bfloat16's weights may be float32 or bfloat16: a flag says which
    torch.float32: [_P] * 7 + [_I] * 5 + [ctypes.c_int],
    torch.bfloat16: [_P, _P, _P, ctypes.c_int, _P, _P, _P, _P] + [_I] * 5 + [ctypes.c_int],
}


def covers(dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the kernel runs experts of these sizes in `dtype` here."""
    found = kernel(dtype)
    if found is None:
        return False
    h, i = _MULTIPLES[found[0]]
    return hidden % h == 0 and inter % i == 0


def layout(weight: torch.Tensor, compact: bool = False) -> torch.Tensor:
    """[E, N, K] (torch's linear weights, stacked) as the kernel of its dtype reads them: in
    float32 as strips of 16 columns, `[E, N / 16, K, 16]`; with `compact`, the same strips
    stored in bfloat16, made from bfloat16 weights (a bfloat16 checkpoint held as it ships) or
    from float32 ones whose every value is a bfloat16 one (`exactly_bfloat16`); in bfloat16 as
    strips of 32 columns in pairs of k, `[E, N / 32, K / 2, 32, 2]`."""
    e, n, k = weight.shape
    if weight.dtype == torch.float32 or compact:
        strips = weight.view(e, n // 16, 16, k).transpose(2, 3)
        stored = torch.bfloat16 if compact else torch.float32
        out = torch.empty(strips.shape, dtype=stored, device=weight.device)
        return out.copy_(strips)  # converted and laid out in the one copy
    return weight.view(e, n // 32, 32, k // 2, 2).transpose(2, 3).contiguous()


def exactly_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of float32 `weight` is a bfloat16 one (its low 16 bits zero), so
    that storing it in bfloat16 loses nothing."""
    bits = weight.detach().reshape(-1).view(torch.int32)
    chunk = 1 << 24  # a pass of 64 MB at a time: no copy the size of a layer's experts
    return not any((bits[i : i + chunk] & 0xFFFF).any() for i in range(0, bits.numel(), chunk))


def routed_experts(
    x: torch.Tensor,  # [T, hidden]
    top_index: torch.Tensor,  # [T, k]: each token's experts
    top_weights: torch.Tensor,  # [T, k]: their routing weights (float32, or bfloat16 for x's)
    gate_up: torch.Tensor,  # `layout` of [E, 2 * inter, hidden] (float32's `compact` or not)
    down: torch.Tensor,  # `layout` of [E, hidden, inter], as gate_up
    inter: int,
    isa: str | None = None,
) -> torch.Tensor:
    """Each token's sum of its experts' down(silu(gate) * up) times their weights, [T, hidden]:
    the whole routed part of the layer in one call (csrc/moe_routing.h), by the kernel of `isa`
    (one of `kernels(x.dtype)`; by default the first)."""
    tokens, hidden = x.shape
    num_experts, k = gate_up.shape[0], top_index.shape[1]
    dtype = x.dtype
    if dtype == torch.float32:
        assert top_weights.dtype == torch.float32
    else:
        assert top_weights.dtype in (torch.float32, torch.bfloat16)
    assert gate_up.is_contiguous() and down.is_contiguous() and gate_up.dtype == down.dtype
    x, weights = x.contiguous(), top_weights.contiguous()
    index = top_index.to(torch.int64).contiguous()
    outs = torch.empty(tokens * k, hidden, dtype=dtype)
    out = torch.empty(tokens, hidden, dtype=dtype)
    found = kernels(dtype, gate_up.dtype)
    run = found[0][1] if isa is None else dict(found)[isa]
    flag = () if dtype == torch.float32 else (weights.dtype == torch.float32,)
    run(
        x.data_ptr(), index.data_ptr(), weights.data_ptr(), *flag, gate_up.data_ptr(),
        down.data_ptr(), outs.data_ptr(), out.data_ptr(), tokens, k, num_experts, hidden, inter,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
