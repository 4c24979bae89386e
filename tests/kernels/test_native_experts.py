"""The experts kernels (`kernels.native_experts`: float32 on AVX-512 and on AVX2; bfloat16 on
AMX's tile unit and on AVX512-BF16's dot products) give each row its expert's SwiGLU, as the
reference computes it up to the order of float32 sums (in bfloat16, rounded where transformers
rounds): experts with no row, one, and counts around each kernel's tiles (4, 12 and 16 rows, 32
columns). The bfloat16 kernels take the whole routed layer: each token's k experts, weighted
and summed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_build, native_experts

# every kernel this CPU can run: its dtype and instruction set (the tests of the others skip)
KERNELS = [
    pytest.param(torch.float32, "avx512", id="float32-avx512",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_avx512_f32(),
                                          reason="no AVX-512 (F, DQ) and FMA")),
    pytest.param(torch.float32, "avx2", id="float32-avx2",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_avx2(), reason="no AVX2 and FMA")),
    pytest.param(torch.bfloat16, "amx", id="bfloat16-amx",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_amx_bf16(), reason="no AMX")),
    pytest.param(torch.bfloat16, "avx512_bf16", id="bfloat16-avx512_bf16",
                 marks=pytest.mark.skipif(not cpu_build.cpu_has_avx512_bf16(),
                                          reason="no AVX512-BF16")),
]  # fmt: skip


def swiglu(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """In float32 sums, rounded to the rows' dtype after each product, SiLU and the product
    with up, as transformers' bfloat16 experts round."""
    dtype = rows.dtype
    gate, up = (rows.float() @ gate_up.float().T).to(dtype).chunk(2, dim=-1)
    act = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    return (act.float() @ down.float().T).to(dtype)


# (hidden, inter) for each kernel: the smallest it takes, and Qwen3-MoE's shape scaled down
SIZES = {"avx2": [(64, 24), (32, 8), (512, 192)], "avx512": [(64, 24), (32, 8), (512, 192)],
         "amx": [(32, 32), (96, 64), (512, 192)],
         "avx512_bf16": [(32, 32), (96, 64), (512, 192)]}  # fmt: skip
CASES = [
    pytest.param(*kernel.values, hidden, inter, id=f"{kernel.id}-{hidden}x{inter}",
                 marks=kernel.marks)
    for kernel in KERNELS for hidden, inter in SIZES[kernel.values[1]]
]  # fmt: skip
COUNTS = [[0, 1, 3, 4, 5, 9, 0, 2], [1], [17, 0, 0, 8], [13, 16, 33, 0, 47]]


@pytest.mark.parametrize("dtype, isa, hidden, inter", CASES)
@pytest.mark.parametrize("counts", COUNTS)
def test_each_row_gets_its_experts_swiglu(dtype, isa, hidden, inter, counts) -> None:
    if isa not in dict(native_experts.kernels(dtype)):
        pytest.fail(f"the {isa} kernel did not build or load on a CPU that has the instructions")
    g = torch.Generator().manual_seed(len(counts) + hidden)
    experts = len(counts)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    rows = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    got = run(isa, rows, counts, native_experts.layout(gate_up), native_experts.layout(down), inter)
    starts = torch.tensor([0, *counts]).cumsum(0).tolist()
    want = torch.cat([
        swiglu(rows[starts[e] : starts[e + 1]], gate_up[e], down[e]) for e in range(experts)
    ])  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a sum in another order may round an intermediate the other way: a bfloat16 ulp
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert (got == want).float().mean() > 0.9


def run(isa, rows, counts, gate_up, down, inter) -> torch.Tensor:
    """Each row (grouped by expert, `counts` each) through its expert: one expert a token,
    weight 1, so that the routed layer's output is each row's SwiGLU."""
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[:, None]
    ones = torch.ones(index.shape, dtype=rows.dtype)
    return native_experts.routed_experts(rows, index, ones, gate_up, down, inter, isa)


@pytest.mark.parametrize("dtype, isa", KERNELS)
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype, isa) -> None:
    """What batch-invariant mode needs of the kernels, which run every step there."""
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(3, 128, 64, generator=g) * 0.125).to(dtype)
    down = (torch.randn(3, 64, 64, generator=g) * 0.125).to(dtype)
    packed = native_experts.layout(gate_up), native_experts.layout(down)
    rows = torch.randn(40, 64, generator=g).to(dtype)
    every = run(isa, rows, [20, 3, 17], *packed, 64)
    alone = run(isa, rows[20:23], [0, 3, 0], *packed, 64)
    assert torch.equal(every[20:23], alone)


ROUTED = [  # each kernel with each dtype its routing weights come in
    pytest.param(*k.values, w, id=f"{k.id}-weights-{str(w)[6:]}", marks=k.marks)
    for k in KERNELS for w in (torch.float32, torch.bfloat16) if w in (k.values[0], torch.float32)
]  # fmt: skip


@pytest.mark.parametrize("dtype, isa, weights_dtype", ROUTED)
@pytest.mark.parametrize("experts, threads", [(6, 1), (6, 2), (2, 2), (16, 2)])
def test_the_routed_layer_weighs_and_sums_each_tokens_experts(
    dtype, isa, weights_dtype, experts, threads, monkeypatch
):
    """As transformers combines them: each expert's output times its weight (rounded to
    bfloat16 with a bfloat16 weight), the token's k of them summed in float32 (rounded to
    bfloat16). On one thread and two; with few experts a thread each expert's columns are cut
    into parts."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(3)
    hidden, inter, tokens, k = 96, 64, 37, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.125).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[:20] = torch.tensor([0, 1])  # experts 0 and 1 get more than a tile of 16 rows
    weights = torch.rand(tokens, k, generator=g).to(weights_dtype)
    got = native_experts.routed_experts(
        x, index, weights, native_experts.layout(gate_up), native_experts.layout(down), inter,
        isa,
    )  # fmt: skip
    outs = torch.stack([
        torch.cat([swiglu(x[t : t + 1], gate_up[e], down[e]) for e in index[t].tolist()])
        for t in range(tokens)
    ])  # fmt: skip
    want = (outs * weights[..., None]).sum(dim=1).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert (got == want).float().mean() > 0.9


@pytest.mark.skipif(not cpu_build.cpu_has_avx512_f32(), reason="no AVX-512 (F, DQ) and FMA")
@pytest.mark.parametrize("hidden, inter, tokens", [(512, 192, 1), (512, 192, 300), (64, 24, 37)])
def test_the_float32_kernels_agree_bit_for_bit(hidden, inter, tokens) -> None:
    """One source built for AVX-512's 16 lanes and AVX2's 8: a float32 result must not depend
    on which the CPU has (24: the activation's last 8 columns past AVX-512's 16)."""
    assert native_experts.kernel(torch.float32)[0] == "avx512"
    g = torch.Generator().manual_seed(tokens)
    experts, k = 8, 3
    gate_up = native_experts.layout(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1)
    down = native_experts.layout(torch.randn(experts, hidden, inter, generator=g) * 0.1)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    got = {isa: native_experts.routed_experts(x, index, weights, gate_up, down, inter, isa)
           for isa in ("avx512", "avx2")}  # fmt: skip
    assert torch.equal(got["avx512"], got["avx2"])


F32_KERNELS = [k for k in KERNELS if k.values[0] == torch.float32]


@pytest.mark.parametrize("dtype, isa", F32_KERNELS)
@pytest.mark.parametrize("experts, threads", [(6, 1), (2, 2), (16, 2)])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_float32_weights_kept_in_bfloat16_give_the_same_results(
    dtype, isa, experts, threads, tokens, monkeypatch
):
    """float32 weights whose values are all bfloat16 ones (a bfloat16 checkpoint computing in
    float32), stored in bfloat16 and widened as the kernel reads them: the same results bit for
    bit as from their float32 storage, whole experts a thread or parts of them, every tile."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(tokens + experts)
    hidden, inter, k = 64, 24, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.125).bfloat16().float()
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).bfloat16().float()
    assert native_experts.exactly_bfloat16(gate_up) and native_experts.exactly_bfloat16(down)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)

    def run(compact: bool) -> torch.Tensor:
        packed = [native_experts.layout(w, compact) for w in (gate_up, down)]
        assert packed[0].dtype == (torch.bfloat16 if compact else torch.float32)
        return native_experts.routed_experts(x, index, weights, *packed, inter, isa)

    assert torch.equal(run(compact=True), run(compact=False))


def test_exactly_bfloat16_means_every_value() -> None:
    w = torch.randn(3, 40, 16).bfloat16().float()
    assert native_experts.exactly_bfloat16(w)
    w[2, 39, 15] += 2.0**-20  # one value past bfloat16's 8 bits of mantissa
    assert not native_experts.exactly_bfloat16(w)
    assert not native_experts.exactly_bfloat16(torch.randn(100))


def test_the_weights_layout_is_each_kernels() -> None:
    w = torch.arange(2 * 32 * 6, dtype=torch.float32).view(2, 32, 6)  # [E, N, K]
    strips = native_experts.layout(w)  # [E, N / 16, K, 16]
    assert strips.shape == (2, 2, 6, 16) and strips.is_contiguous()
    assert strips[1, 1, 4, 3].item() == w[1, 19, 4].item()
    exact = w % 256  # every value a bfloat16 one: the same strips, stored in bfloat16
    compact = native_experts.layout(exact, compact=True)
    assert compact.dtype == torch.bfloat16
    assert torch.equal(compact.float(), native_experts.layout(exact))
    w = torch.arange(2 * 64 * 6, dtype=torch.bfloat16).view(2, 64, 6)
    strips = native_experts.layout(w)  # [E, N / 32, K / 2, 32, 2]
    assert strips.shape == (2, 2, 3, 32, 2) and strips.is_contiguous()
    assert strips[1, 1, 2, 3].tolist() == [w[1, 35, 4].item(), w[1, 35, 5].item()]


def test_what_the_kernels_cover() -> None:
    if cpu_build.cpu_has_avx2():  # with AVX-512 too: faster than oneDNN's AVX-512 products
        assert native_experts.covers(torch.float32, 512, 192)
        assert not native_experts.covers(torch.float32, 520, 192)  # hidden: 16 a vector pair
        assert not native_experts.covers(torch.float32, 512, 196)
    if cpu_build.cpu_has_avx512_bf16():
        assert native_experts.covers(torch.bfloat16, 512, 192)
        assert not native_experts.covers(torch.bfloat16, 528, 192)  # hidden: a strip's 32
        assert not native_experts.covers(torch.bfloat16, 512, 208)  # inter: 32, gate/up strips
    if cpu_build.cpu_has_amx_bf16():
        assert native_experts.kernel(torch.bfloat16)[0] == "amx"
    else:
        assert not any(isa == "amx" for isa, _ in native_experts.kernels(torch.bfloat16))
    assert not native_experts.covers(torch.float16, 512, 192)
