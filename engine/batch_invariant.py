"""Batch-invariant mode (`--batch-invariant`): a request's tokens and logprobs do not depend on
what else is in its step, so a result reused from another batch is bit for bit the one a fresh
run gives.

One row of a matrix product can come out differently with another number of rows beside it:
BLAS libraries pick the kernel, the blocking and the threads by shape (MKL's float32 product on
an AVX-512 CPU sums in another order below 8 rows), and a step's row count is its batch's. In
this mode every product runs in tiles of exactly `ROW_TILE` rows, the last padded with zeros,
so the library meets one shape per weight and each row's sums are always taken in one order.
Attention already reduces each query over its own keys alone; what the batch decides there is
switched off: cascade attention (a shared prefix's partial sums merged in another order) and
the Triton decode kernel's split of long contexts (its count is chosen from the batch's size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# 64 rows: as fast as the untiled product from a few hundred rows up (oneDNN, bfloat16), and a
# decode batch of 64 needs no padding; a smaller batch pays for 64 rows
ROW_TILE = 64


def in_row_tiles(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = ROW_TILE
) -> torch.Tensor:
    """`product(x)` for x [..., features], run on tiles of exactly `tile` rows of x: whole
    tiles in place, the rows left over copied into a tile of zeros."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    whole = rows - rows % tile
    outs = [product(flat[start : start + tile]) for start in range(0, whole, tile)]
    if whole < rows or rows == 0:
        last = flat.new_zeros(tile, flat.shape[1])
        last[: rows - whole] = flat[whole:]
        outs.append(product(last)[: rows - whole])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])
