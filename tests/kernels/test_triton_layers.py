"""kernels.triton_layers, the CUDA path's norms, rope and activation, against the eager modules
they replace (engine.models.layers), compiled on a GPU and through Triton's interpreter on the
CPU: equal to eager's but for the order of float32 sums."""

from __future__ import annotations

import os

import torch

COMPILED = torch.cuda.is_available()
if not COMPILED:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if COMPILED else "cpu"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conveyor.engine.models.layers import add_rms_norm, apply_rope, rms_norm  # noqa: E402
from conveyor.kernels import triton_layers as tl_  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def on_the_kernels_device():
    with torch.device(DEVICE):
        yield


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # rounded where eager rounds: equal but for a rare tie after a float32 sum
    assert (got != want).float().mean() < 0.01
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-8 * scale)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(DEVICE).manual_seed(sum(shape))).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96, 2048])
def test_rms_norm_matches_eager(dtype, dim):
    x, w = randn(7, dim, dtype=dtype), 1 + 0.1 * randn(dim, dtype=dtype)
    assert_close(tl_.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_writes_the_sum_into_the_residual(dtype):
    x, residual = randn(5, 96, dtype=dtype), randn(5, 97, dtype=dtype)[:, :96].contiguous()
    w = 1 + 0.1 * randn(96, dtype=dtype)
    want, want_sum = add_rms_norm(x, residual, w, 1e-5)
    got = tl_.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(residual, want_sum)  # one rounding of one sum: exact
    assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_norm_rope_rotates_the_packed_views_in_place(dtype, head_dim, qk_norm):
    tokens, heads, kv_heads = 6, 4, 2
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, q_size + kv_size :].clone()
    angles = randn(tokens, 1, head_dim // 2, dtype=torch.float32)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    q_w, k_w = 1 + 0.1 * randn(head_dim, dtype=dtype), 1 + 0.1 * randn(head_dim + 1, dtype=dtype)
    k_w = k_w[:head_dim]
    if qk_norm:
        want_q, want_k = apply_rope((cos, sin), rms_norm(q, q_w, 1e-6), rms_norm(k, k_w, 1e-6))
        got_q = tl_.norm_rope_(q, cos, sin, q_w, 1e-6)
        got_k = tl_.norm_rope_(k, cos, sin, k_w, 1e-6)
    else:
        want_q, want_k = apply_rope((cos, sin), q, k)
        got_q, got_k = tl_.norm_rope_(q, cos, sin), tl_.norm_rope_(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [100, 1500])
def test_silu_mul_matches_eager(dtype, inter):
    gate_up = randn(3, 2 * inter, dtype=dtype)
    gate, up = gate_up.split(inter, dim=-1)
    assert_close(tl_.silu_mul(gate_up), F.silu(gate) * up)


def test_no_rows_launch_nothing():
    empty = torch.empty(0, 64)
    assert tl_.rms_norm(empty, torch.ones(64), 1e-6).shape == (0, 64)
    assert tl_.silu_mul(torch.empty(0, 128)).shape == (0, 64)
    q = torch.empty(0, 2, 64)
    assert tl_.norm_rope_(q, torch.empty(0, 64), torch.empty(0, 64)) is q


def test_layouts_the_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match="even head_dim"):
        tl_.norm_rope_(torch.zeros(2, 2, 64).transpose(1, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="x's dtype"):
        x = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
        tl_.norm_rope_(x, torch.zeros(2, 64), torch.zeros(2, 64))
