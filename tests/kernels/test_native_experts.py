"""The float32 experts kernel (`kernels.native_experts`, AVX2) gives each row its expert's
SwiGLU, as the reference computes it up to float32 rounding: experts with no row, one, and
counts around its tile of four rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_build, native_experts

pytestmark = pytest.mark.skipif(not cpu_build.cpu_has_avx2(), reason="this CPU has no AVX2 and FMA")


def swiglu(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (rows @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


@pytest.mark.parametrize("hidden, inter", [(64, 24), (32, 8), (512, 192)])
@pytest.mark.parametrize("counts", [[0, 1, 3, 4, 5, 9, 0, 2], [1], [17, 0, 0, 8]])
def test_each_row_gets_its_experts_swiglu(hidden, inter, counts) -> None:
    g = torch.Generator().manual_seed(len(counts) + hidden)
    experts = len(counts)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    rows = torch.randn(sum(counts), hidden, generator=g)
    got = native_experts.experts(
        rows, torch.tensor(counts), gate_up.transpose(1, 2).contiguous(),
        down.transpose(1, 2).contiguous(),
    )  # fmt: skip
    starts = torch.tensor([0, *counts]).cumsum(0).tolist()
    want = torch.cat([
        swiglu(rows[starts[e] : starts[e + 1]], gate_up[e], down[e]) for e in range(experts)
    ])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_the_kernel_covers() -> None:
    assert native_experts.covers(torch.float32, 512, 192)
    assert not native_experts.covers(torch.bfloat16, 512, 192)
    assert not native_experts.covers(torch.float32, 520, 192)  # hidden: 16 a vector pair
    assert not native_experts.covers(torch.float32, 512, 196)
    most = native_experts.MAX_ROWS_PER_EXPERT * 64
    assert native_experts.worth_it(most, 64) and not native_experts.worth_it(most + 1, 64)
