"""The decoder layer's elementwise steps in Triton, for CUDA: RMSNorm with the residual add
before it, the per-head q/k norm with rope, and SiLU(gate) * up, one kernel each.

Eager torch runs a layer's norms, rope and activation as ~30 launches (casts, a reduction,
products, a concatenation for rotate-half); these are 4. In a decode step that is what costs:
each launch is a few microseconds of GPU time however small the batch, and inside a CUDA graph
the count of kernels sets the floor of a step.

Results are rounded to the model's dtype where the eager modules (and transformers) round them
(`_rounded`), so they match the eager path up to the order of float32 sums. With
`TRITON_INTERPRET=1` they run on the CPU, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton_paged import on_device


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (to nearest, ties to even), kept in float32. For bfloat16
    by integer arithmetic: with a plain cast the GPU compiler may fuse a bfloat16 product into
    the sum that follows (an FMA: one rounding fewer than eager's, a differing last bit in a
    fifth of rope's outputs), and Triton's interpreter truncates instead of rounding."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_r, stride_o, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x + r, dtype)  # the stream is kept in the model's dtype
        tl.store(res_ptr + row * stride_r + cols, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = _rounded(x * tl.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _rounded(w * normed, dtype).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x's rows ([..., dim]); with `residual`, of (x + residual), which is also
    written back into `residual` (the stream the next layer adds to)."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = flat.shape[0]
    if rows == 0:
        return out
    res = flat if residual is None else residual.view(-1, dim)
    if residual is not None and (res.shape != flat.shape or res.stride(-1) != 1):
        raise ValueError("residual must have x's shape with its last dim contiguous")
    block = triton.next_power_of_2(dim)
    with on_device(x.device):
        _rms_norm_kernel[(rows,)](
            flat, res, weight, out.view(-1, dim), dim,
            flat.stride(0), res.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["rows"])
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, rows, heads, stride_xt, stride_xh, stride_ct, eps,
    HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    # a program takes BLOCK_R heads (rows of x seen as [tokens * heads, head_dim]), the halves
    # of each head side by side as the columns of a [BLOCK_R, HALF_P2] tile
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t, h = r // heads, r % heads
    half = HEAD_DIM // 2
    i = tl.arange(0, HALF_P2)
    mask = (r < rows)[:, None] & (i < half)[None, :]
    dtype = x_ptr.dtype.element_ty
    base = x_ptr + (t * stride_xt + h * stride_xh)[:, None] + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        inv = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        x1 = _rounded(w1 * _rounded(x1 * inv, dtype), dtype)
        x2 = _rounded(w2 * _rounded(x2 * inv, dtype), dtype)
    angles = cos_ptr + (t * stride_ct)[:, None] + i[None, :]
    c1 = tl.load(angles, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(angles + half, mask=mask, other=0.0).to(tl.float32)
    angles = sin_ptr + (t * stride_ct)[:, None] + i[None, :]
    s1 = tl.load(angles, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(angles + half, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as eager rounds it
    o1 = _rounded(_rounded(x1 * c1, dtype) + _rounded(-x2 * s1, dtype), dtype)
    o2 = _rounded(_rounded(x2 * c2, dtype) + _rounded(x1 * s2, dtype), dtype)
    tl.store(base, o1.to(dtype), mask=mask)
    tl.store(base + half, o2.to(dtype), mask=mask)


# values a norm_rope_ program takes (16 heads of 128): fewer, fuller programs than one a head;
# Triton's interpreter runs programs one after another, so there the count is what costs
NORM_ROPE_TILE = 2048


def norm_rope_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Rope over x ([T, heads, head_dim], each head's values contiguous) in place, with cos and
    sin ([T, head_dim] or [T, 1, head_dim], x's dtype); with `weight`, each head RMS-normed
    first (Qwen3's q/k norm). Returns x."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or head_dim % 2:
        raise ValueError("rope needs an even head_dim with each head's values contiguous")
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if cos.stride() != sin.stride() or cos.stride(1) != 1 or cos.dtype != x.dtype:
        raise ValueError("cos and sin must be laid out alike, rows contiguous, in x's dtype")
    if tokens == 0:
        return x
    half_p2 = triton.next_power_of_2(head_dim // 2)
    block_r = max(1, NORM_ROPE_TILE // (2 * half_p2))
    rows = tokens * heads
    with on_device(x.device):
        _norm_rope_kernel[(triton.cdiv(rows, block_r),)](
            x, x if weight is None else weight, cos, sin, rows, heads, x.stride(0), x.stride(1),
            cos.stride(0), eps,
            HEAD_DIM=head_dim, HALF_P2=half_p2, BLOCK_R=block_r, HAS_NORM=weight is not None,
            num_warps=4,
        )  # fmt: skip
    return x


SILU_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * stride_o + cols, _rounded(act * u, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, gate and up the two halves of each row of `gate_up`."""
    width = gate_up.shape[-1]
    flat = gate_up.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if flat.shape[0] == 0:
        return out
    with on_device(gate_up.device):
        _silu_mul_kernel[(flat.shape[0], triton.cdiv(inter, SILU_BLOCK))](
            flat, out.view(-1, inter), inter, flat.stride(0), inter, BLOCK=SILU_BLOCK
        )
    return out
