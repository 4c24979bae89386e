"""Paged attention in float32 for x86 CPUs with AVX2 and FMA, from
`csrc/paged_attention_f32.cpp`: the engine's attention where it computes in float32 (CPUs
without fast bfloat16 products, or a float32 model anywhere).

Like `native_paged`'s bfloat16 kernels they read each sequence's K/V blocks in place through
the block table, once per KV head for all the query heads that share it, with an online softmax
per block. The decode: at a step of 96 sequences with contexts of 32-400 (an AVX2-only CPU, 2
cores) it runs 1.3-1.5x as fast as the inductor-compiled decode (`compiled_paged`), which stays
the decode for the shapes this kernel does not take. The prefill takes every chunk of the step
in one call, a vector's lanes of query vectors (rows times the query heads of a KV head) a
task, where `torch_paged`'s runs torch's fused attention a sequence at a time, with a gathered
copy of its cache where some of it was cached before: with AVX2's 8 lanes 4-30x as fast for a
step of many short prompts (a small model's), 1.6-3.9x for prompts of 64-1,024 tokens at head
size 64 (1.0-1.4x after 1,024 cached); at 128, torch's runs contexts past
`MAX_WIDE_PREFILL_CONTEXT` faster, and runs them (`runs_prefill`). On a CPU with AVX-512 the
source is built for its 16 lanes too (`libraries`), and that build runs: its prefill gives the
same results bit for bit as AVX2's, 1.45-1.75x as fast (a 4,096-token step), and outruns
torch's at every context (1.3-2.1x at head sizes 96-256 and 512-4,096 tokens; measured on an
Intel Xeon, not on an AMD EPYC, whose 512-bit units are two 256-bit halves). Both cover blocks
of 16 tokens, the head sizes of `HEAD_DIMS` (Phi-3's 96 and Gemma's 256 among them), up to 16
query heads per KV head, a sliding window and a soft cap on the scores; `write_kv` copies the
step's keys and values into their slots a row at a time.

Built with the C++ compiler on first use and cached as `native_paged`'s kernel is
(`kernels.cpu_build`); `covers` says whether its kernels run these shapes here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from conveyor.kernels import native_paged
from conveyor.kernels.cpu_build import load_f32_builds

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_f32.cpp"
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the kernel's instances (csrc/paged_attention_f32.cpp)
# the longest context in a step up to which AVX2's prefill runs heads wider than 64: past it
# torch's fused attention, which reads each K/V block for more queries at a time, is faster
# (at 128 on an AMD EPYC: 1.3-1.8x torch's speed up to 512 tokens, 0.8-0.9x at 1,024 and
# more). AVX-512's prefill, 16 queries a tile, ran 1.3-2.1x torch's at 512-4,096 tokens.
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
def libraries() -> tuple[tuple[str, ctypes.CDLL], ...]:
    """The kernel's builds that run here, fastest first, each with its instruction set: for
    AVX-512's 16 lanes (its prefill's tiles 16 query vectors) and for AVX2's 8; none where
    none can be built or run here."""
    fallback = "float32 attention uses the inductor decode and torch's prefill"
    builds = load_f32_builds(SOURCE, "float32 attention", fallback)
    found = tuple((isa, lib) for isa, lib in builds if lib is not None)
    for _, lib in found:
        native_paged.declare(lib, "f32")
    return found


def _library() -> ctypes.CDLL | None:
    """The fastest build here, or None."""
    found = libraries()
    return found[0][1] if found else None


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
    if query.shape[2] <= 64 or libraries()[0][0] == "avx512":
        return True
    return max(context_lens, default=0) <= MAX_WIDE_PREFILL_CONTEXT


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
    isa: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and results as `torch_paged.prefill_attention`, this step's K/V already in
    the cache: each chunk's queries attend causally to their sequence's blocks, a vector's
    lanes of query vectors (rows times the query heads of a KV head) at a time. `isa`: the
    build to run (one of `libraries()`; by default the first)."""
    assert _library() is not None, "check covers() first"
    lib = _library() if isa is None else dict(libraries())[isa]
    return native_paged.run_prefill(
        lib.conveyor_paged_prefill_f32, query, k_cache, v_cache, block_tables,
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
