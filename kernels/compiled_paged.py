"""Paged decode attention for the CPU, compiled by torch.compile (inductor's C++/OpenMP code).

The eager decode in `torch_paged` copies every sequence's K/V blocks out of the pool before the
matmuls, and on a CPU that copy costs about three times the attention itself. Written as plain
indexing and reductions over the pool, inductor turns the block-table lookups into indirect
loads inside its loops, so the gathered copy is never made: about 3x faster at batch 120 and
contexts of 200-520.

One compile per model shape (KV heads, group size, head size, block size, dtype): about 15 s
the first time, a few seconds once inductor's disk cache (`$TORCHINDUCTOR_CACHE_DIR`, by default
`~/.cache/conveyor/inductor`) has it. Batch size, table width and
pool size are dynamic, so no later step compiles again. It needs a C++ compiler.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from conveyor.kernels.compile_limits import compile_kernel
from conveyor.kernels.cpu_build import cache_dir, cxx

log = logging.getLogger(__name__)

# P@V is summed in column chunks of this width: inductor then keeps one accumulator per chunk
# in a single loop that reads each V row once, in order, instead of striding through V per chunk
PV_CHUNK = 16


def _decode_core(query, k_cache, v_cache, tables, context_lens, first, scale: float, softcap):
    """tables: [B, W] block ids, where columns past a sequence's last block repeat that block
    (so every load is of a real block already in cache; the mask drops those positions);
    first: [B] each sequence's first visible position (0, or where its window starts)."""
    batch, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    width = tables.shape[1]
    k = k_cache[tables].permute(0, 2, 1, 3, 4)  # [B, kv, W, bs, d]: indirect loads, fused
    v = v_cache[tables].permute(0, 2, 1, 3, 4)
    q = (query.float() * scale).view(batch, kv_heads, group, 1, 1, head_dim)
    scores = (q * k.float()[:, :, None]).sum(-1)  # [B, kv, g, W, bs]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(width, device=query.device)[:, None] * block_size + torch.arange(
        block_size, device=query.device
    )
    valid = (positions[None] < context_lens[:, None, None]) & (
        positions[None] >= first[:, None, None]
    )  # [B, W, bs]
    scores = torch.where(valid[:, None, None], scores, float("-inf"))
    top = scores.amax(dim=(3, 4), keepdim=True)
    probs = torch.exp(scores - top)
    total = probs.sum(dim=(3, 4), keepdim=True)
    probs = probs / total
    lse = (top + torch.log(total)).view(batch, heads)
    parts = []
    for g in range(group):
        p = probs[:, :, g, :, :, None]  # [B, kv, W, bs, 1]
        for c in range(0, head_dim, PV_CHUNK):
            parts.append((p * v[..., c : c + PV_CHUNK].float()).sum(dim=(2, 3)))
    out = torch.cat(parts, -1)  # [B, kv, g * d]
    return out.view(batch, heads, head_dim).to(query.dtype), lse


def _persistent_cache() -> None:
    """Keep inductor's compiled code where a reboot does not wipe it (its default is under
    /tmp): a later start loads the decode kernel instead of compiling it again."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir("inductor"))


_persistent_cache()


@functools.cache
def _compiled() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The compiled decode, made on first use: making it imports inductor (~1.6 s), which a
    process whose attention all runs the native kernels never needs."""
    return compile_kernel(_decode_core, dynamic=False)


def _mark_dynamic(query, k_cache, v_cache, tables, lens, first) -> None:
    # Batch, table width and pool size are unbacked sizes: one graph for every value, 1
    # included (mark_dynamic would specialise on 1). Head counts, head size and block size
    # stay static so inductor can unroll and vectorise over them. The batch hint of 1 makes it
    # split work over (batch, KV head), which keeps both cores busy for small batches too.
    from torch._dynamo.decorators import mark_unbacked as mark

    for t in (query, tables, lens, first):
        mark(t, 0, shape_id="batch", hint_override=1)
    mark(tables, 1, hint_override=32)
    mark(k_cache, 0, shape_id="num_blocks", hint_override=4096)
    mark(v_cache, 0, shape_id="num_blocks", hint_override=4096)


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B], each >= 1
    scale: float,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and results as `torch_paged.decode_attention`."""
    if query.shape[0] == 0:
        out = torch.empty_like(query)
        return (out, query.new_empty(query.shape[:2], dtype=torch.float32)) if return_lse else out
    block_size = k_cache.shape[2]
    num_blocks = (context_lens + (block_size - 1)) // block_size
    parts = split_by_width(num_blocks)
    if parts is None:
        out, lse = _decode(
            query, k_cache, v_cache, block_tables, context_lens, num_blocks, scale, window, softcap
        )
    else:
        out = torch.empty_like(query)
        lse = query.new_empty(query.shape[:2], dtype=torch.float32)
        for rows in parts:
            out[rows], lse[rows] = _decode(
                query[rows],
                k_cache,
                v_cache,
                block_tables[rows],
                context_lens[rows],
                num_blocks[rows],
                scale,
                window,
                softcap,
            )
    return (out, lse) if return_lse else out


def split_by_width(num_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every sequence is computed over as many blocks as the longest one (masked past its own
    end), so a few long contexts among many short ones (sequences outside a cascade prefix,
    say) multiply the work. Returns the rows of the short and the long sequences when running
    them as two calls saves at least a quarter of the blocks, else None."""
    n = num_blocks.shape[0]
    if n < 2:
        return None
    widths, order = torch.sort(num_blocks)
    short = torch.arange(1, n, device=num_blocks.device)  # sequences in the short call
    blocks = short * widths[:-1] + (n - short) * widths[-1]
    best = int(torch.argmin(blocks))
    if 4 * int(blocks[best]) > 3 * n * int(widths[-1]):
        return None
    return order[: best + 1], order[best + 1 :]


def _decode(
    query, k_cache, v_cache, block_tables, context_lens, num_blocks, scale, window, softcap
):
    # one set of guards whatever the caller's grad mode or index dtypes: no recompiles (a
    # split's rows are selected outside, so they are the same kind of tensor as unsplit ones)
    with torch.inference_mode():
        width = int(num_blocks.max())
        cols = torch.arange(width, device=query.device)
        last = torch.minimum(cols[None, :], num_blocks[:, None] - 1)
        tables = torch.gather(block_tables[:, :width], 1, last).to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64, copy=True)
        first = torch.zeros_like(lens) if window is None else (lens - window).clamp_(min=0)
        _mark_dynamic(query, k_cache, v_cache, tables, lens, first)
        cap = None if softcap is None else float(softcap)
        return _compiled()(query, k_cache, v_cache, tables, lens, first, float(scale), cap)


def compiler_missing() -> str | None:
    """Why inductor cannot build CPU code here, or None."""
    if cxx() is None:
        wanted = os.environ.get("CXX") or "g++"
        return f"no C++ compiler ({wanted}) on PATH; install g++ or set CXX"
    return None
