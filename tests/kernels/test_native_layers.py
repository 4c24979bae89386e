"""The native norm, rope and activation kernels (`kernels.native_layers`) give the eager
functions' results: in bfloat16 (AVX512-BF16) bit for bit, bar the order of the norm's float32
sum; in float32 (AVX2) rope and the residual sum bit for bit, the norm but for its sum's order
and SiLU within its e^x's error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.engine.models.layers import add_rms_norm, apply_rope, rms_norm
from conveyor.kernels import cpu_build, native_layers

BF16, F32 = torch.bfloat16, torch.float32
needs_bf16 = pytest.mark.skipif(
    not cpu_build.cpu_has_avx512_bf16(), reason="this CPU has no AVX512-BF16"
)
needs_avx2 = pytest.mark.skipif(not cpu_build.cpu_has_avx2(), reason="this CPU has no AVX2 and FMA")
DTYPES = [pytest.param(BF16, marks=needs_bf16), pytest.param(F32, marks=needs_avx2)]
TOKENS = [1, 3, 96, 4096]  # 4,096 rows split over threads


def randn(*shape, scale=1.0, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of elements that differ."""
    return (a != b).float().mean().item()


def assert_norm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: a few elements a rounding apart; float32: the sum's order, ~1e-7 relative."""
    if got.dtype == BF16:
        assert differ(got, want) < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_and_residual_add(tokens, dtype) -> None:
    x, residual = (
        randn(tokens, 512, scale=4, seed=1, dtype=dtype),
        randn(tokens, 512, seed=2, dtype=dtype),
    )
    weight = randn(512, seed=3, dtype=dtype)
    assert_norm_close(native_layers.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    want, want_sum = add_rms_norm(x, residual, weight, 1e-6)
    stream = residual.clone()
    got = native_layers.rms_norm(x, weight, 1e-6, stream)
    assert torch.equal(stream, want_sum)  # the sum, written into the residual stream
    assert_norm_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows(dtype) -> None:
    """Qwen3's per-head norm takes q as a view into the packed q/k/v output."""
    qkv = randn(5, 3 * 4 * 32, seed=4, dtype=dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = randn(32, seed=5, dtype=dtype)
    got = native_layers.rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape
    assert_norm_close(got, rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(tokens, dtype) -> None:
    gate_up = randn(tokens, 2 * 1408, scale=3, seed=6, dtype=dtype)
    gate, up = gate_up.split(1408, dim=-1)
    got, want = native_layers.silu_mul(gate_up), F.silu(gate) * up
    if dtype == BF16:
        assert torch.equal(got, want)
    else:  # e^x is the kernel's own, within ~1e-7 of torch's
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
        assert differ(got, want) < 0.5  # most are equal: the same formula, rounded the same
    special = [-200.0, -30, 0, 30, 200, float("inf"), float("-inf"), float("nan")]
    extreme = torch.tensor([special * 12 + [1.0] * 96]).to(dtype)
    gate, up = extreme.split(96, dim=-1)
    rtol = 0 if dtype == BF16 else 2e-6
    torch.testing.assert_close(
        native_layers.silu_mul(extreme), F.silu(gate) * up, rtol=rtol, atol=0, equal_nan=True
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 80, 96, 128, 256])
def test_rope(tokens, head_dim, dtype) -> None:
    heads, kv_heads = 8, 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, scale=2, seed=7, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=torch.Generator().manual_seed(8))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[:, None].float() * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    rope = emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)
    want_q, want_k = apply_rope(rope, q, k)
    got_q, got_k = native_layers.rope(*rope, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 32000), (96, 32000), (5, 37), (3, 151936), (4, 7)])
def test_first_max_index(rows, n, dtype) -> None:
    logits = randn(rows, n, seed=9, dtype=dtype)
    assert torch.equal(native_layers.first_max_index(logits), logits.max(dim=-1).indices)
    tied = torch.randint(0, 3, (50, n), generator=torch.Generator().manual_seed(10)).to(dtype)
    assert torch.equal(native_layers.first_max_index(tied), tied.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_max_index_of_nan_and_minus_infinity_rows(dtype) -> None:
    """As torch: a NaN wins (the first one); a row of -inf gives its first index."""
    logits = torch.full((5, 40), float("-inf"), dtype=dtype)
    logits[1, 20] = logits[1, 7] = float("nan")
    logits[2, 35] = 1.0  # past the last whole vector of 16 (and of float32's run of 32)
    logits[3, 5] = 2.0
    logits[3, 38] = float("nan")  # a NaN in the tail, after a maximum in the whole vectors
    logits[4, 3] = logits[4, 33] = 1.0  # a tie across the whole vectors and the tail
    assert native_layers.first_max_index(logits).tolist() == [0, 7, 35, 38, 3]
    assert logits.max(dim=-1).indices.tolist() == [0, 7, 35, 38, 3]
