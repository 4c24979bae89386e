"""Paged decode attention in float32 for x86 CPUs with AVX2 and FMA, from
`csrc/paged_attention_f32.cpp`: the engine's decode attention where it computes in float32
(CPUs without fast bfloat16 products, or a float32 model anywhere).

Like `native_paged`'s bfloat16 kernel it reads each sequence's K/V blocks in place through the
block table, once per KV head for all the query heads that share it, with an online softmax per
block: at a decode step of 96 sequences with contexts of 32-400 (an AVX2-only CPU, 2 cores) it
runs 1.3-1.5x as fast as the inductor-compiled decode (`compiled_paged`), which stays the decode for
the shapes this kernel does not take. It covers blocks of 16 tokens, the head sizes of
`HEAD_DIMS` (Phi-3's 96 and Gemma's 256 among them), up to 16 query heads per KV head, a sliding
window and a soft cap on the scores.

Built with the C++ compiler on first use and cached as `native_paged`'s kernel is
(`kernels.cpu_build`); `covers` says whether it runs a decode here.
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
    lib = load_avx2(SOURCE, "float32 decode uses the inductor kernel")
    if lib is not None:
        fn = lib.conveyor_paged_decode_f32
        fn.restype = ctypes.c_int
        # 7 pointers; batch, heads, kv heads, head size, table width; scale, threads, window
        # (0: none), soft cap (0: none)
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [
            ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_float,
        ]  # fmt: skip
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
    query = query.contiguous()
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32) if return_lse else None
    if query.shape[0]:
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        status = _library().conveyor_paged_decode_f32(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(),
            query.shape[0], query.shape[1], k_cache.shape[1], query.shape[2], tables.shape[1],
            float(scale), torch.get_num_threads(), window or 0, float(softcap or 0.0),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"the float32 attention kernel does not cover {tuple(query.shape)}")
    return (out, lse) if return_lse else out
