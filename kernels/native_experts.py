"""A mixture-of-experts layer's experts in float32 for x86 CPUs with AVX2 and FMA, from
`csrc/experts_f32.cpp`: for each expert, its rows times the gate/up weight, SiLU(gate) * up and
the down weight, whole experts a thread. On a 2-core AVX2 CPU, with 8 experts of 64 a token, it
runs a layer in 2.2x (8-128 tokens: bound by reading the weights, as it should be) to 1.2x
(1,024 tokens) the time of torch's grouped products; at 4,096 tokens the two are even, so
`worth_it` sends steps of more rows per expert than that to the grouped products.

The weights are read k-major (`[E, hidden, 2 * inter]` and `[E, inter, hidden]` contiguous),
which is what `Experts` lays its weights out as once this kernel runs it; torch's grouped
product reads the same layout as its `weight.transpose(1, 2)`.

Built and cached like the other CPU kernels (`kernels.cpu_build`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conveyor.kernels.cpu_build import load_avx2

SOURCE = Path(__file__).parent / "csrc" / "experts_f32.cpp"
MAX_ROWS_PER_EXPERT = 128  # on average, past which the grouped product is as fast


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_avx2(SOURCE, "experts run as grouped products")
    if lib is not None:
        fn = lib.conveyor_experts_f32
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
    return lib


def covers(dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the kernel runs experts of these sizes in `dtype` here."""
    return dtype == torch.float32 and hidden % 16 == 0 and inter % 8 == 0 and _library() is not None


def worth_it(rows: int, num_experts: int) -> bool:
    """Whether a step of `rows` (token, expert) pairs runs faster here than grouped."""
    return rows <= MAX_ROWS_PER_EXPERT * num_experts


def experts(
    rows: torch.Tensor,  # [R, hidden] float32, grouped by expert
    counts: torch.Tensor,  # [E] int64: each expert's rows, in expert order
    gate_up_t: torch.Tensor,  # [E, hidden, 2 * inter] contiguous
    down_t: torch.Tensor,  # [E, inter, hidden] contiguous
) -> torch.Tensor:
    """down(silu(gate) * up) of each row by its expert: [R, hidden]."""
    hidden, inter = rows.shape[1], down_t.shape[1]
    assert gate_up_t.is_contiguous() and down_t.is_contiguous() and counts.dtype == torch.int64
    rows = rows.contiguous()
    counts = counts.contiguous()
    scratch = rows.new_empty(rows.shape[0], 2 * inter)
    out = rows.new_empty(rows.shape[0], hidden)
    _library().conveyor_experts_f32(
        rows.data_ptr(), counts.data_ptr(), gate_up_t.data_ptr(), down_t.data_ptr(),
        scratch.data_ptr(), out.data_ptr(), counts.shape[0], hidden, inter,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
