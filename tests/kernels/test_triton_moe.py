"""The Triton experts kernels against the torch experts: compiled, on the GPU, where there is
one; on Triton's CPU interpreter elsewhere."""

from __future__ import annotations

import os

import torch

COMPILED = torch.cuda.is_available()
if not COMPILED:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if COMPILED else "cpu"

import pytest  # noqa: E402

from conveyor.engine.models import moe  # noqa: E402
from conveyor.engine.models.layers import EAGER, TRITON  # noqa: E402
from conveyor.kernels import triton_moe  # noqa: E402
from tests.hf_reference import assert_greedy_matches_hf_through  # noqa: E402


def routed(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """Each token's k distinct experts, drawn unevenly: the first experts get most tokens,
    the last none."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g) * torch.linspace(2, 0.5, experts)
    scores[:, -1] = -1  # never chosen
    return scores.topk(k, dim=-1).indices.to(DEVICE)


def test_tiles_hold_one_expert_each_and_every_pair_once():
    top_index = routed(53, 6, 3, seed=0)
    rows, tile_expert = triton_moe.tile_layout(top_index, 6, block_m=16)
    pairs = top_index.numel()
    flat = top_index.reshape(-1)
    tiles = rows.view(-1, 16)
    seen = []
    for tile, expert in zip(tiles.tolist(), tile_expert.tolist(), strict=True):
        real = [p for p in tile if p < pairs]
        if expert < 0:
            assert not real  # the tiles past the last hold only padding
            continue
        assert real and all(int(flat[p]) == expert for p in real)
        assert real == tile[: len(real)]  # padding only at a tile's end
        seen += real
    assert sorted(seen) == list(range(pairs))
    assert tile_expert.max() < 5  # the last expert got no token and no tile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_products_equal_the_torch_experts(dtype, monkeypatch):
    """Hidden and intermediate sizes that fill no tile exactly; experts with no token."""
    torch.manual_seed(1)
    experts = moe.Experts(num_experts=7, hidden=40, inter=72).to(DEVICE, dtype)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.3)
        experts.down.normal_(0, 0.3)
    x = torch.randn(37, 40, device=DEVICE, dtype=dtype)
    top_index = routed(37, 7, 2, seed=2)
    weights = torch.rand(37, 2, device=DEVICE).to(dtype)
    experts.impl = EAGER
    experts.grouped = False
    calls = []
    kernel = triton_moe.expert_products
    monkeypatch.setattr(triton_moe, "expert_products", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        want = experts(x, top_index, weights)
        assert not calls
        experts.use_kernel(TRITON)
        got = experts(x, top_index, weights)
    assert calls == [1]  # one call, both products
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    assert not torch.isnan(got).any()


def test_no_tokens_no_launch():
    experts = moe.Experts(num_experts=3, hidden=16, inter=16).to(DEVICE)
    empty = triton_moe.expert_products(
        torch.zeros(0, 16, device=DEVICE), experts.gate_up, experts.down,
        torch.zeros(0, 2, dtype=torch.long, device=DEVICE),
    )  # fmt: skip
    assert empty.shape == (0, 16)


def test_engine_greedy_matches_transformers_through_triton_experts(checkpoints, monkeypatch):
    """A mixture-of-experts model on the CUDA path whole: Triton attention, elementwise steps
    and experts."""
    calls = []
    kernel = triton_moe.expert_products
    monkeypatch.setattr(triton_moe, "expert_products", lambda *a: calls.append(1) or kernel(*a))
    assert_greedy_matches_hf_through(
        checkpoints["qwen3_moe"], "triton", seed=5, device=DEVICE, elementwise="triton",
        experts="triton",
    )  # fmt: skip
    assert calls
