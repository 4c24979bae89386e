"""The decoder layer's elementwise steps as one pass each over their rows, for x86 CPUs: RMSNorm
with the residual add before it, rope, and SiLU(gate) * up; in bfloat16 with AVX512-BF16
(`csrc/layers_bf16.cpp`), in float32 with AVX2 and FMA (`csrc/layers_f32.cpp`); both also
have a greedy step's pick, each row's first maximum (`first_max_index`), and the float32 one a
sampled row's draw (`draw`). Each function takes the kernel of its input's dtype.

Each is one ctypes call. Eager torch makes several passes (in bfloat16 converting to float32
and back in each), and inductor's compiled versions of the same functions cost 40-50 us a call
to enter, dozens of calls a decode step. Results are rounded where the eager modules round
them, so they match the eager path up to the order of float32 sums (and, in float32, SiLU's
e^x within ~1e-7).

Built and cached like `native_paged`'s kernel (`kernels.cpu_build`); `available(dtype)` says
whether the kernel of that dtype runs here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conveyor.kernels.cpu_build import AVX2_UNFUSED_FLAGS, load_avx2, load_avx512_bf16

SOURCE = Path(__file__).parent / "csrc" / "layers_bf16.cpp"
SOURCE_F32 = Path(__file__).parent / "csrc" / "layers_f32.cpp"
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# each kernel's sizes: hidden and intermediate sizes, head sizes, multiples of these
_MULTIPLES = {torch.bfloat16: (16, 16), torch.float32: (8, 16)}
_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _bind(lib: ctypes.CDLL, suffix: str) -> None:
    signatures = {
        "rms_norm": [_P, _I, _P, _P, _P, _I, _I, _F, _T],
        "silu_mul": [_P, _I, _P, _I, _I, _T],
        "rope": [_P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _T],
        "argmax": [_P, _I, _I, _I, _P, _T],
        "draw": [_P, _I, _I, _I, _P, _P, _P, _P, _P, _T],
    }
    for name, argtypes in signatures.items():
        if name == "draw" and suffix != "f32":
            continue  # sampling runs in float32 whatever the model's dtype
        fn = getattr(lib, f"conveyor_{name}_{suffix}")
        fn.argtypes, fn.restype = argtypes, None


@functools.cache
def _library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernel of `dtype`, built and loaded; None where it cannot be built or run here."""
    fallback = "norms, rope and activation stay compiled or eager"
    if dtype == torch.bfloat16:
        lib = load_avx512_bf16(SOURCE, fallback)
    elif dtype == torch.float32:
        lib = load_avx2(SOURCE_F32, fallback, AVX2_UNFUSED_FLAGS)
    else:
        return None
    if lib is not None:
        _bind(lib, _NAMES[dtype])
    return lib


def available(dtype: torch.dtype) -> bool:
    return _library(dtype) is not None


def covers(hidden: int, head_dim: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether these kernels take a model of these sizes in `dtype` (and built here)."""
    return refusal(hidden, head_dim, intermediate, dtype) is None


def refusal(hidden: int, head_dim: int, intermediate: int, dtype: torch.dtype) -> str | None:
    """Why these kernels do not take a model of these sizes in `dtype` here, in words; None
    where they do."""
    name = str(dtype).removeprefix("torch.")
    if dtype not in _MULTIPLES:
        return f"no native kernels for {name}"
    width, head = _MULTIPLES[dtype]
    if hidden % width or intermediate % width or head_dim % head:
        return (f"the native {name} kernels take hidden and intermediate sizes of multiples of "
                f"{width} and head sizes of {head}; this model's are {hidden}, {intermediate} "
                f"and {head_dim}")  # fmt: skip
    if not available(dtype):
        return f"the native {name} kernels do not run on this CPU (or did not build)"
    return None


def _call(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    return getattr(_library(dtype), f"conveyor_{name}_{_NAMES[dtype]}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A CPU tensor [..., dim] as [rows, dim] with each row contiguous (a view where the rows
    are evenly spaced, else a copy)."""
    assert x.dtype in _NAMES and x.device.type == "cpu"
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
    _call("rms_norm", x.dtype)(
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
    _call("silu_mul", gate_up.dtype)(
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
    _call("rope", q.dtype)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), tokens, q_heads, k_heads, dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as `x.max(dim=-1).indices` (a NaN wins), for [rows, n]
    logits: one pass, in bfloat16 5-8x faster than torch's float32 reduction, in float32
    ~5x torch's (0.5 against 2.8 ms for 96 x 32,000 on an Intel Xeon with AVX-512)."""
    flat = _rows(x)
    out = torch.empty(flat.shape[0], dtype=torch.int64)
    _call("argmax", x.dtype)(
        flat.data_ptr(), flat.shape[0], flat.shape[1], flat.stride(0), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each float32 row's sampled token at its `temperature`, `min_p`, `top_p` (none: 1) and
    uniform number `u` in [0, 1) (float32 tensors, one value a row): the inverse of the
    cumulative sum of softmax(row / temperature) at u, summed in float64, over the tokens that
    top-p keeps (its nucleus: the most likely tokens whose weight, in float64, first reaches
    top_p of the row's, with every token tied with the last of them) and min_p keeps (those at
    least min_p times the most likely one's weight) (`csrc/layers_f32.cpp`'s `draw`). One pass
    to find the maximum, two over the weights, no temporary tensors: 256 x 32,000 in ~7 ms on
    one thread, against ~23 for softmax, a float64 copy, its cumulative sum and a search (~70
    where those copies are new memory each time); a nucleus costs four passes more over the
    weights, where a sort of the row costs several times the whole draw."""
    flat = _rows(logits)
    assert flat.dtype == torch.float32
    rows = flat.shape[0]
    if top_p is None:
        top_p = torch.ones(rows)
    settings = [v.to(torch.float32).contiguous() for v in (temperature, min_p, top_p, u)]
    assert all(v.shape == (rows,) for v in settings)
    out = torch.empty(rows, dtype=torch.int64)
    t, p, nucleus, uniform = settings
    _call("draw", torch.float32)(
        flat.data_ptr(), rows, flat.shape[1], flat.stride(0), t.data_ptr(), p.data_ptr(),
        nucleus.data_ptr(), uniform.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
