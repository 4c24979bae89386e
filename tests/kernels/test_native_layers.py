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


def torch_draw(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, u):
    """The torch path's draw (engine.sampler): softmax, min_p, float64 cumulative sum, search."""
    from conveyor.engine.sampler import _inverse_cdf

    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p[:, None], 0)
    return _inverse_cdf(probs, u)


@needs_avx2
@pytest.mark.parametrize("rows, n", [(256, 32000), (8, 151936), (40, 100), (30, 13), (9, 64)])
def test_draw_picks_the_token_the_torch_draw_picks(rows, n) -> None:
    """The same uniform number gives the same token as softmax, a float64 cumulative sum and a
    search (the sums' orders differ, so a draw within rounding of a token's edge could differ:
    none of these does), at temperatures and min_p's of every kind, flat and peaked rows."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(rows, n, generator=g) * torch.linspace(0.1, 12, rows)[:, None]
    temperature = torch.rand(rows, generator=g) * 1.9 + 0.1
    min_p = torch.where(torch.arange(rows) % 3 == 0, torch.rand(rows, generator=g) * 0.5, 0.0)
    u = torch.rand(rows, generator=g)
    want = torch_draw(logits, temperature, min_p, u)
    assert torch.equal(native_layers.draw(logits, temperature, min_p, u), want)
    strided = torch.randn(rows, n + 5, generator=g)[:, :n]  # rows apart by more than n
    got = native_layers.draw(strided, temperature, min_p, u)
    assert torch.equal(got, torch_draw(strided.contiguous(), temperature, min_p, u))


def torch_nucleus_draw(logits, temperature, min_p, top_p, u):
    """The torch path's draw with top-p: the sorted nucleus, then softmax, min_p and search."""
    from conveyor.engine.sampler import _sorted_top_k_top_p

    vocab = torch.full((logits.shape[0],), float(logits.shape[1]))
    kept = _sorted_top_k_top_p(logits / temperature[:, None], vocab, top_p)
    return torch_draw(kept, torch.ones(logits.shape[0]), min_p, u)


@needs_avx2
@pytest.mark.parametrize("rows, n", [(128, 32000), (8, 151936), (64, 100), (40, 13), (30, 3000)])
def test_draw_with_top_p_picks_the_token_the_sorted_nucleus_gives(rows, n) -> None:
    """Top-p inside the draw (its nucleus from a histogram of the weights, no sort) takes the
    token that the sorted nucleus, softmax and a search take, at top_p's from tiny (the most
    likely token alone) to nearly 1, with temperatures and min_p's (applied after top-p, as
    torch's path applies them), flat and peaked rows, strided rows; a row with top_p 1 draws
    as without it."""
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(rows, n, generator=g) * torch.linspace(0.1, 12, rows)[:, None]
    temperature = torch.rand(rows, generator=g) * 1.9 + 0.1
    min_p = torch.where(torch.arange(rows) % 4 == 0, torch.rand(rows, generator=g) * 0.3, 0.0)
    top_p = torch.rand(rows, generator=g) ** 0.3  # most of them near 1, where nuclei are wide
    top_p[::7] = 1e-4
    top_p[1::7] = 1.0
    u = torch.rand(rows, generator=g)
    for x in (logits, torch.randn(rows, n + 3, generator=g)[:, :n]):  # and rows apart by more
        got = native_layers.draw(x, temperature, min_p, u, top_p)
        want = torch_nucleus_draw(x.contiguous(), temperature, min_p, top_p, u)
        # the two sum the nucleus in different orders and precisions (float64 here, float32
        # there), so a row whose p falls within rounding of a token's edge may keep one token
        # more or less: such a row takes the token a p a hair either side gives
        for r in (got != want).nonzero().flatten().tolist():
            edges = [torch_nucleus_draw(x[r : r + 1].contiguous(), temperature[r : r + 1],
                                        min_p[r : r + 1], (top_p[r : r + 1] + d).clamp(max=1),
                                        u[r : r + 1]).item() for d in (-1e-6, 1e-6)]  # fmt: skip
            assert got[r].item() in edges, (r, got[r], want[r], edges)
        assert (got != want).sum() <= max(1, rows // 25)
    assert torch.equal(got[1::7], native_layers.draw(x, temperature, min_p, u)[1::7])


@needs_avx2
def test_top_p_keeps_every_token_tied_at_the_edge_of_the_nucleus() -> None:
    """Weights 0.4, 0.2, 0.2, 0.2 (and tokens under them) with top_p 0.5: the nucleus ends
    among the three tied 0.2's, and all three stay in it (a sort would keep whichever came
    first): each of the four is drawn as often as its weight among them says; a token of
    weight 0.1 past the nucleus never is. The same with the tie split by blocks of 64."""
    for where in ([0, 1, 2, 3, 4], [70, 3, 130, 64, 5]):
        row = torch.full((1, 200), float("-inf"))
        row[0, where] = torch.tensor([0.4, 0.2, 0.2, 0.2, 0.1]).log()
        draws = 40_000
        many = row.expand(draws, -1).contiguous()
        u = torch.rand(draws, generator=torch.Generator().manual_seed(4))
        tokens = native_layers.draw(many, torch.ones(draws), torch.zeros(draws), u,
                                    torch.full((draws,), 0.5))  # fmt: skip
        counts = torch.bincount(tokens, minlength=200).double() / draws
        want = torch.tensor([0.4, 0.2, 0.2, 0.2])
        sigma = (want * (1 - want) / draws).sqrt()
        assert ((counts[where[:4]] - want).abs() <= 5 * sigma).all(), counts[where]
        assert counts[where[4]] == 0


@needs_avx2
def test_draw_of_masked_edge_and_non_finite_rows() -> None:
    """A -inf token is never drawn; u at 0 draws the first token with weight and u just under
    1 the last; min_p 1 keeps only the most likely; a row whose maximum is not finite gives
    that maximum's index, as the greedy pick does."""
    inf, nan = float("inf"), float("nan")
    logits = torch.full((7, 70), -inf)
    logits[0, [3, 66]] = 0.0  # two tokens left, the second in the tail past the block of 64
    logits[1, [3, 66]] = 0.0
    logits[2, :] = torch.linspace(0, 1, 70)
    logits[2, 5] = 1.0  # ties the last token, the first of the two is the most likely
    logits[4, 9] = nan
    logits[5, 12] = inf
    logits[6, [10, 20]] = 5.0
    u = torch.tensor([0.0, 1 - 2**-24, 0.3, 0.5, 0.5, 0.5, 0.999])
    min_p = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    got = native_layers.draw(logits, torch.ones(7), min_p, u).tolist()
    assert got[:3] == [3, 66, 5] and got[3] == 0 and got[4:6] == [9, 12] and got[6] == 20
    many = logits[0:1].expand(20_000, -1).contiguous()
    drawn = native_layers.draw(many, torch.ones(20_000), torch.zeros(20_000), torch.rand(20_000))
    assert set(drawn.tolist()) == {3, 66}


@needs_avx2
def test_draw_never_takes_a_token_without_weight_where_rounding_leaves_the_target_passed():
    """A block's sum (its lanes added apart, then together) can exceed its tokens' running sum
    (added one by one): a token of weight 1 then 63 of ~5.6e-17 each, which added one by one
    to 1 round away, sum to 1 + ~3e-15 by lanes. With u = 1/2 and a second token of weight 1
    two blocks on, the target falls between the two sums, so the scan passes the block without
    reaching it; the block after, all -inf, must not give a token: the next with weight does."""
    row = torch.full((1, 200), float("-inf"))
    row[0, 0] = 0.0
    row[0, 1:64] = -37.43  # e^x ~ 5.6e-17, under half a float64 ulp of 1
    row[0, 128] = 0.0
    got = native_layers.draw(row, torch.ones(1), torch.zeros(1), torch.tensor([0.5]))
    assert got.tolist() in ([128], *([i] for i in range(64)))
