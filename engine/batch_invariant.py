"""Batch-invariant mode (`--batch-invariant`): a request's tokens and logprobs do not depend on
what else is in its step, so a result reused from another batch is bit for bit the one a fresh
run gives.

One row of a matrix product can come out differently with another number of rows beside it:
BLAS libraries pick the kernel, the blocking and the threads by shape (MKL's float32 product on
an AVX-512 CPU sums in another order below 8 rows), and a step's row count is its batch's. In
this mode every product runs in tiles of a few fixed sizes, so the library meets the same
shapes whatever the batch: rows in groups of `GROUP_ROWS` while there are that many, then in
tiles of `ROW_TILE`, the rows left over in the smallest tile that holds them, padded with
zeros. A size other than `ROW_TILE` (a group, or one of `PART_TILES`) is used only where this
machine's product gives a row the same bits in it as in a tile of `ROW_TILE`, checked once per
weight when the mode is switched on (`tiles_for`). Attention already reduces each query over
its own keys alone; what the batch decides there is switched off: cascade attention (a shared
prefix's partial sums merged in another order) and the Triton decode kernel's split of long
contexts (its count is chosen from the batch's size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Product = Callable[[torch.Tensor], torch.Tensor]

# 64 rows: as fast as the untiled product from a few hundred rows up (oneDNN, bfloat16), and a
# decode batch of 64 needs no padding
ROW_TILE = 64
# for the rows left over: a decode batch of 40 pays for 48 rows, not 64
PART_TILES = (16, 32, 48)
# for a prefill step's thousands of rows: one call per 512 of them, not per 64
GROUP_ROWS = 8 * ROW_TILE


@torch.inference_mode()
def tiles_for(products: Iterable[tuple[Product, torch.Tensor]]) -> tuple[int, ...]:
    """The sizes, smallest first, that every one of `products` (each with an input row of its
    width, dtype and device) may run: `ROW_TILE`, and each of `PART_TILES` and `GROUP_ROWS`
    whose rows equal, bit for bit, the same rows in tiles of `ROW_TILE`. Random rows show a
    different order of summation at once."""
    sizes = {*PART_TILES, GROUP_ROWS}
    g = torch.Generator().manual_seed(0)
    for product, like in products:
        rows = torch.randn(GROUP_ROWS, like.shape[-1], generator=g).to(like)
        tiled = torch.cat([product(tile) for tile in rows.split(ROW_TILE)])
        sizes = {size for size in sizes if _same_rows(product, rows, tiled, size)}
    return (*sorted(sizes - {GROUP_ROWS}), ROW_TILE, *sorted(sizes & {GROUP_ROWS}))


def _same_rows(product: Product, rows: torch.Tensor, tiled: torch.Tensor, size: int) -> bool:
    """Whether `size` rows at a time give `tiled`'s bits, at the start and at the end."""
    return torch.equal(product(rows[:size].clone()), tiled[:size]) and torch.equal(
        product(rows[-size:].clone()), tiled[-size:]
    )


def in_row_tiles(
    product: Product, x: torch.Tensor, tiles: tuple[int, ...] = (ROW_TILE,)
) -> torch.Tensor:
    """`product(x)` for x [..., features], run on `tiles` (sizes, smallest first) of rows of x:
    as many as fit of each size from `ROW_TILE` up, largest first, in place; the rows left
    over copied into the smallest that holds them, padded with zeros."""
    flat = x.reshape(-1, x.shape[-1])
    rows, start, outs = flat.shape[0], 0, []
    for size in reversed([t for t in tiles if t >= ROW_TILE]):
        while rows - start >= size:
            outs.append(product(flat[start : start + size]))
            start += size
    left = rows - start
    if left or rows == 0:
        last = flat.new_zeros(min(t for t in tiles if t >= left), flat.shape[1])
        last[:left] = flat[start:]
        outs.append(product(last)[:left])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])
