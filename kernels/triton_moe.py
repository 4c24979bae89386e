"""A mixture of experts' two projections in Triton, for CUDA: every expert in one launch per
projection, over the (token, expert) pairs sorted by expert.

The pairs are laid out in tiles of `BLOCK_M` rows, each tile holding one expert's pairs only
(an expert's last tile padded with a sentinel), and each tile names its expert, so one grid
covers every expert with no host synchronisation: the layout is built on the device from the
router's choices, its size bounded by `pairs / BLOCK_M + experts` tiles. The first launch reads
each pair's token row and writes SiLU(gate) * up, the second the down projection of that; the
routing weights, the return to token order and the sum over a token's experts are what the torch
path does after its products (`engine.models.moe.Experts`), so the two round alike.

With `TRITON_INTERPRET=1` the kernels run on the CPU, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton_layers import _rounded
from conveyor.kernels.triton_paged import _dot_fp32, _precision, on_device

BLOCK_M = 16  # pairs per tile; at least 16 for tl.dot
BLOCK_N = 64
BLOCK_K = 32


def tile_layout(top_index: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """The (token, expert) pairs of `top_index` [tokens, k] (pair t * k + j: token t's j-th
    expert) in tiles of one expert each: (each tile row's pair, `pairs` where it is padding;
    each tile's expert, -1 for the tiles past the last)."""
    expert_ids, perm = torch.sort(top_index.reshape(-1), stable=True)
    pairs = expert_ids.numel()
    device = expert_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids)
    )  # a fixed shape, unlike bincount
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    num_tiles = triton.cdiv(pairs, block_m) + num_experts  # bound on sum(ceil(count / block_m))
    rank = torch.arange(pairs, device=device) - start[expert_ids]
    rows = torch.full((num_tiles * block_m,), pairs, dtype=torch.int64, device=device)
    rows[padded_start[expert_ids] + rank] = perm
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return rows, tile_expert.to(torch.int32)


@triton.jit
def _experts_kernel(
    a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, num_pairs, top_k, N, K,
    stride_a, stride_we, stride_wn, stride_o,
    GATED: tl.constexpr, TOKEN_ROWS: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[pair, n] = (a[row] · w[expert, n]) for each pair of the tile, a's row the pair's
    token (TOKEN_ROWS) or the pair itself; GATED: SiLU(a · w[e, n]) * (a · w[e, N + n])."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = pairs // top_k if TOKEN_ROWS else pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dtype = out_ptr.dtype.element_ty
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
            w_mask = (ks[:, None] < K) & (cols[None, :] < N)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
            if GATED:
                up = tl.load(w_base + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask,
                             other=0.0)  # fmt: skip
                if DOT_FP32:
                    up = up.to(tl.float32)
                acc_up += tl.dot(a, up, input_precision=PRECISION)
        if GATED:  # rounded where the torch path rounds: each product, SiLU, the product
            gate = _rounded(acc, dtype)
            act = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
            acc = act * _rounded(acc_up, dtype)
        out_mask = valid[:, None] & (cols[None, :] < N)
        tl.store(out_ptr + pairs[:, None] * stride_o + cols[None, :],
                 _rounded(acc, dtype).to(dtype), mask=out_mask)  # fmt: skip


def _launch(a, weight, rows, tile_expert, num_pairs, top_k, n, gated, token_rows):
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    with on_device(a.device):
        _experts_kernel[grid](
            a, weight, out, rows, tile_expert, num_pairs, top_k, n, a.shape[1],
            a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            GATED=gated, TOKEN_ROWS=token_rows, DOT_FP32=_dot_fp32(a.dtype),
            PRECISION=_precision(a.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return out


# token counts whose (token, expert) pair counts are of each kind of integer Triton compiles a
# kernel apart for (1, a multiple of 16, neither), whatever top_k is
TOKENS_TO_WARM = (1, 2, 16)


def warm_up(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> None:
    """Compile now the experts kernels' variants a step can meet with these weights, instead
    of in the middle of traffic (a pair count is an argument Triton keys). Zero inputs; the
    outputs are thrown away."""
    hidden, num_experts = gate_up.shape[2], gate_up.shape[0]
    for tokens in TOKENS_TO_WARM:
        x = torch.zeros((tokens, hidden), dtype=gate_up.dtype, device=gate_up.device)
        top_index = torch.arange(tokens * top_k, device=x.device).view(tokens, top_k) % num_experts
        expert_products(x, gate_up, down, top_index)


def expert_products(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_index: torch.Tensor
) -> torch.Tensor:
    """Each (token, expert) pair's expert output, [tokens * k, hidden], the pairs in the order
    `top_index.reshape(-1)` lists them; `gate_up` [E, 2 * inter, hidden], `down` [E, hidden,
    inter]."""
    x = x.contiguous()
    pairs = top_index.numel()
    rows, tile_expert = tile_layout(top_index, gate_up.shape[0])
    k, inter = top_index.shape[-1], down.shape[2]
    h = _launch(x, gate_up, rows, tile_expert, pairs, k, inter, gated=True, token_rows=True)
    return _launch(h, down, rows, tile_expert, pairs, k, down.shape[1], gated=False,
                   token_rows=False)  # fmt: skip
