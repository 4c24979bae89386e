"""Paged attention in float32 for x86 CPUs with AVX2 and FMA, from
`csrc/paged_attention_f32.cpp`: the engine's attention where it computes in float32 (CPUs
without fast bfloat16 products, or a float32 model anywhere).

Like `native_paged`'s bfloat16 kernels they read each sequence's K/V blocks in place through
the block table, once per KV head for all the query heads that share it, with an online softmax
per block. The decode: at a step of 96 sequences with contexts of 32-400 (an AVX2-only CPU, 2
cores) it runs 1.3-1.5x as fast as the inductor-compiled decode (`compiled_paged`), which stays
the decode for the shapes this kernel does not take. The prefill takes every chunk of the step
in one call, 8 query vectors (rows times the query heads of a KV head) a task, where
`torch_paged`'s runs torch's fused attention a sequence at a time, with a gathered copy of its
cache where some of it was cached before: 4-30x as fast for a step of many short prompts
(a small model's), 1.6-3.9x for prompts of 64-1,024 tokens at head size 64 (1.0-1.4x after
1,024 cached); at 128, torch's runs contexts past `MAX_WIDE_PREFILL_CONTEXT` faster, and runs
them (`runs_prefill`). Both cover blocks of 16 tokens, the head sizes of `HEAD_DIMS` (Phi-3's
96 and Gemma's 256 among them), up to 16 query heads per KV head, a sliding window and a soft
cap on the scores; `write_kv` copies the step's keys and values into their slots a row at a
time.

Built with the C++ compiler on first use and cached as `native_paged`'s kernel is
(`kernels.cpu_build`); `covers` says whether its kernels run these shapes here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conveyor.kernels import native_paged
from conveyor.kernels.cpu_build import load_avx2

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_f32.cpp"
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the kernel's instances (csrc/paged_attention_f32.cpp)
# the longest context in a step up to which the prefill kernel runs heads wider than 64: past
# it torch's fused attention, which reads each K/V block for more queries at a time, is faster
# (at 128: 1.3-1.8x torch's speed up to 512 tokens, 0.8-0.9x at 1,024 and more)
MAX_WIDE_PREFILL_CONTEXT = 512


def covers(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel runs this decode (dtype, device, shapes, and it built here)."""
    return (
        query.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and native_paged.takes_shape(query, k_cache, HEAD_DIMS)
        and _library() is not None
    )


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built or run here."""
    lib = load_avx2(SOURCE, "float32 attention uses the inductor decode and torch's prefill")
    if lib is not None:
        native_paged.declare(lib, "f32")
    return lib


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, kv_heads, 16, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B], each >= 1
    scale: float,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and results as `torch_paged.decode_attention`, for what `covers` accepts."""
    assert _library() is not None, "check covers() first"
    return native_paged.run_decode(
        _library().conveyor_paged_decode_f32, query, k_cache, v_cache, block_tables,
        context_lens, scale, return_lse, window, softcap,
    )  # fmt: skip


def runs_prefill(query: torch.Tensor, k_cache: torch.Tensor, context_lens: list[int]) -> bool:
    """Whether the prefill kernel runs this step's prompts (`covers`, and faster than torch's
    for its head size and longest context)."""
    if not covers(query, k_cache):
        return False
    return query.shape[2] <= 64 or max(context_lens, default=0) <= MAX_WIDE_PREFILL_CONTEXT


def prefill_attention(
    query: torch.Tensor,  # [T, heads, head_dim] float32, the chunks back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start: list[int],  # [S + 1]
    context_lens: list[int],  # [S] tokens in the cache after this chunk
    scale: float,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and results as `torch_paged.prefill_attention`, this step's K/V already in
    the cache: each chunk's queries attend causally to their sequence's blocks, 8 query
    vectors (rows times the query heads of a KV head) at a time."""
    assert _library() is not None, "check covers() first"
    return native_paged.run_prefill(
        _library().conveyor_paged_prefill_f32, query, k_cache, v_cache, block_tables,
        query_start, context_lens, scale, return_lse, window, softcap,
    )  # fmt: skip


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim] float32
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Same as `torch_paged.write_kv`, one copy per row instead of index_put's scatter."""
    native_paged.write_rows(
        _library().conveyor_write_kv_f32, key, value, k_cache, v_cache, slot_mapping
    )
