"""The decoder layer's elementwise steps in bfloat16 for x86 CPUs with AVX512-BF16, from
`csrc/layers_bf16.cpp`: RMSNorm with the residual add before it, rope, and SiLU(gate) * up;
and a greedy step's pick, each row's first maximum (`first_max_index`).

Each is one pass over its rows and one ctypes call. Eager torch makes several passes in
bfloat16 (converting to float32 and back in each), and inductor's compiled versions of the
same functions cost 40-50 us a call to enter, dozens of calls a decode step. Results are
rounded to bfloat16 where the eager modules round them, so they match the eager path up to
the order of float32 sums.

Built and cached like `native_paged`'s kernel (`kernels.cpu_build`); `available()` says
whether it runs here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conveyor.kernels.cpu_build import load_avx512_bf16

SOURCE = Path(__file__).parent / "csrc" / "layers_bf16.cpp"
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_avx512_bf16(SOURCE, "norms, rope and activation stay compiled or eager")
    if lib is None:
        return None
    lib.conveyor_rms_norm_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _I, _F, _T]
    lib.conveyor_silu_mul_bf16.argtypes = [_P, _I, _P, _I, _I, _T]
    lib.conveyor_rope_bf16.argtypes = [_P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _T]
    lib.conveyor_argmax_bf16.argtypes = [_P, _I, _I, _I, _P, _T]
    for fn in (lib.conveyor_rms_norm_bf16, lib.conveyor_silu_mul_bf16, lib.conveyor_rope_bf16,
               lib.conveyor_argmax_bf16):  # fmt: skip
        fn.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def covers(hidden: int, head_dim: int, intermediate: int) -> bool:
    """Whether these kernels take a model of these sizes (and built here)."""
    return hidden % 16 == 0 and head_dim % 32 == 0 and intermediate % 16 == 0 and available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A bfloat16 CPU tensor [..., dim] as [rows, dim] with each row contiguous (a view where
    the rows are evenly spaced, else a copy)."""
    assert x.dtype == torch.bfloat16 and x.device.type == "cpu"
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x's rows; with `residual`, of (x + residual), which is also written back
    into `residual` (a contiguous [rows, dim] tensor)."""
    flat = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    _library().conveyor_rms_norm_bf16(
        flat.data_ptr(), flat.stride(0), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), out.data_ptr(), flat.shape[0], flat.shape[1], eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, gate and up the two halves of each row of `gate_up`."""
    flat = _rows(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    _library().conveyor_silu_mul_bf16(
        flat.data_ptr(), flat.stride(0), out.data_ptr(), flat.shape[0], inter,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope(
    cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ([T, heads, head_dim], each token's heads contiguous) rotated by cos and sin
    ([T, head_dim] or [T, 1, head_dim]): new contiguous tensors."""
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    assert q.stride(1) == dim and k.stride(1) == dim and q.stride(2) == 1 and k.stride(2) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == q.dtype
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    _library().conveyor_rope_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), tokens, q_heads, k_heads, dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as `x.max(dim=-1).indices` (a NaN wins), for [rows, n]
    bfloat16 logits: one pass in bfloat16, 5-8x faster than torch's float32 reduction."""
    flat = _rows(x)
    out = torch.empty(flat.shape[0], dtype=torch.int64)
    _library().conveyor_argmax_bf16(
        flat.data_ptr(), flat.shape[0], flat.shape[1], flat.stride(0), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out
