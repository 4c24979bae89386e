"""Paged attention in bfloat16 for x86 CPUs with AVX512-BF16, from `csrc/`.

The kernel reads each sequence's K/V blocks in place through the block table and takes Q.K
with the CPU's bfloat16 dot-product instruction: at a decode step of 96 sequences with contexts
of 32-400 it runs 2-3x faster than the inductor-compiled decode (`compiled_paged`), near the
machine's copy bandwidth, with no padding to the longest context. Prefill has its own kernel,
which reads each K/V block once for 16 query vectors (rows times the query heads of a KV head),
takes their scores from a transposed K block and runs their softmax in one pass over the
transposed scores: ~3.4x the decode kernel run a row at a time. On a CPU with AMX, the prefill
runs on the tile unit instead (`csrc/prefill_amx.cpp`, where Linux lends the process the tile
registers): its two products there, the same softmax, the weights kept to ~16 bits; 2.0-2.6x
the dot-product kernel on a 4,096-token step. Both cover blocks of 16
tokens, the head sizes of `HEAD_DIMS` (Phi-3's 96 and Gemma's 256 among them; heads of 16 only
with the dot products) and up to 16 query heads per KV head, with a sliding window (only
the blocks in it are read) and a soft cap on the scores; the compiled backend sends everything
else to `compiled_paged` (decode) and `torch_paged` (prefill).

It is built with the C++ compiler on first use (5-15 s, once per machine and source) into
`~/.cache/conveyor/kernels/` (or `$XDG_CACHE_HOME/conveyor/kernels/`), named by a hash of its
source and flags, and loaded with ctypes; it runs on torch's OpenMP runtime with torch's thread
count (not OpenMP's default for the calling thread, which would be every core).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from conveyor.kernels.cpu_build import load_amx, load_avx512_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_bf16.cpp"
AMX_SOURCE = Path(__file__).parent / "csrc" / "prefill_amx.cpp"
BLOCK_SIZE = 16
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the kernels' instances (csrc/prefill_tile.h)
AMX_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d % 32 == 0)  # the tiles take 32 at a time
MAX_GROUP = 16


def covers(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel runs this decode (dtype, device, shapes, and it built here)."""
    return query.dtype == torch.bfloat16 and takes_shape(query, k_cache) and _library() is not None


def takes_shape(
    query: torch.Tensor, k_cache: torch.Tensor, head_dims: tuple[int, ...] = HEAD_DIMS
) -> bool:
    """Whether the CPU attention kernels in csrc/ take these shapes: blocks of `BLOCK_SIZE`
    tokens in a contiguous cache, a head size of `head_dims`, at most `MAX_GROUP` query heads
    per KV head."""
    heads, kv_heads = query.shape[1], k_cache.shape[1]
    return (
        query.device.type == "cpu"
        and k_cache.shape[2] == BLOCK_SIZE
        and query.shape[2] in head_dims
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and k_cache.is_contiguous()
    )


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built or run here."""
    lib = load_avx512_bf16(SOURCE, "bfloat16 decode uses the inductor kernel")
    if lib is not None:
        declare(lib, "bf16")
    return lib


def declare(lib: ctypes.CDLL, suffix: str) -> None:
    """The signatures of a csrc/ attention library's decode, prefill and K/V write, which every
    dtype's kernels share (`conveyor_paged_decode_<suffix>`, ...)."""
    for name in ("paged_decode", "paged_prefill"):
        declare_attention(getattr(lib, f"conveyor_{name}_{suffix}"))
    fn = getattr(lib, f"conveyor_write_kv_{suffix}")
    fn.restype = None
    # key, its row stride, value, its row stride; slots, caches; tokens, kv heads, head size;
    # threads
    fn.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64] * 2
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64] * 3
        + [ctypes.c_int]
    )


def declare_attention(fn: Callable[..., int]) -> None:
    """The signature of a csrc/ decode or prefill: decode, 7 pointers (prefill, 8); batch (seqs),
    heads, kv heads, head size, table width; scale, threads, window (0: none), soft cap (0:
    none)."""
    pointers = 8 if "prefill" in fn.__name__ else 7
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 5 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_float,
    ]  # fmt: skip


@functools.cache
def prefill_kernels() -> tuple[tuple[str, Callable[..., int]], ...]:
    """The bfloat16 prefill kernels that run here, fastest first, each with its instruction
    set: on AMX's tile unit where the CPU has AMX and Linux lends it to the process, and with
    AVX512-BF16's dot products."""
    found = []
    amx = load_amx(AMX_SOURCE, "bfloat16 prefill uses AVX512-BF16's dot products")
    if amx is not None:
        if amx.conveyor_amx_ready():
            declare_attention(amx.conveyor_paged_prefill_amx)
            found.append(("amx", amx.conveyor_paged_prefill_amx))
        else:
            log.warning("Linux did not lend this process AMX's tile registers: bfloat16 prefill "
                        "uses AVX512-BF16's dot products")  # fmt: skip
    if _library() is not None:
        found.append(("avx512_bf16", _library().conveyor_paged_prefill_bf16))
    return tuple(found)


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim] bfloat16
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Same as `torch_paged.write_kv`, one copy per row instead of index_put's scatter."""
    write_rows(_library().conveyor_write_kv_bf16, key, value, k_cache, v_cache, slot_mapping)


def write_rows(
    write: Callable[..., None],
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`write_kv` by a kernel's `write` (csrc/kv_slots.h): rows of [kv_heads, head_dim]."""
    tokens, kv_heads, head_dim = key.shape
    key, value = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()
                  for t in (key, value))  # fmt: skip
    slots = slot_mapping.to(torch.int64).contiguous()
    write(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), tokens, kv_heads, head_dim,
        torch.get_num_threads(),
    )  # fmt: skip


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim] bfloat16
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
    return run_decode(
        _library().conveyor_paged_decode_bf16, query, k_cache, v_cache, block_tables,
        context_lens, scale, return_lse, window, softcap,
    )  # fmt: skip


def prefill_attention(
    query: torch.Tensor,  # [T, heads, head_dim] bfloat16, the chunks back to back
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
    the cache: each chunk's queries attend causally to their sequence's blocks, 16 query
    vectors (rows times the query heads of a KV head) at a time, by the kernel of `isa` (one of
    `prefill_kernels()`; by default the first that takes this head size)."""
    assert _library() is not None, "check covers() first"
    kernels = dict(prefill_kernels())
    if isa is None:
        isa = next(i for i in kernels if i != "amx" or query.shape[2] in AMX_HEAD_DIMS)
    kernel = kernels[isa]
    return run_prefill(
        kernel, query, k_cache, v_cache, block_tables, query_start, context_lens, scale,
        return_lse, window, softcap,
    )  # fmt: skip


def run_decode(
    kernel: Callable[..., int], query, k_cache, v_cache, block_tables, context_lens, scale,
    return_lse, window, softcap,
):  # fmt: skip
    """`decode_attention` by a decode kernel of csrc/ (`conveyor_paged_decode_*`)."""
    query, out, lse = _outputs(query, return_lse)
    if query.shape[0]:
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        _check(
            kernel(
                query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                lens.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(),
                query.shape[0], query.shape[1], k_cache.shape[1], query.shape[2],
                tables.shape[1], float(scale), torch.get_num_threads(), window or 0,
                float(softcap or 0.0),
            ),
            query,
        )  # fmt: skip
    return (out, lse) if return_lse else out


def run_prefill(
    kernel: Callable[..., int], query, k_cache, v_cache, block_tables, query_start,
    context_lens, scale, return_lse, window, softcap,
):  # fmt: skip
    """`prefill_attention` by a prefill kernel of csrc/ (`conveyor_paged_prefill_*`)."""
    query, out, lse = _outputs(query, return_lse)
    if query.shape[0]:
        tables = block_tables.to(torch.int32).contiguous()
        starts = torch.tensor(query_start, dtype=torch.int32)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        _check(
            kernel(
                query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                starts.data_ptr(), lens.data_ptr(), out.data_ptr(),
                None if lse is None else lse.data_ptr(), len(context_lens), query.shape[1],
                k_cache.shape[1], query.shape[2], tables.shape[1], float(scale),
                torch.get_num_threads(), window or 0, float(softcap or 0.0),
            ),
            query,
        )  # fmt: skip
    return (out, lse) if return_lse else out


def _outputs(
    query: torch.Tensor, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The query as the kernels read it, and the output (and log-sum-exp) they write."""
    query = query.contiguous()
    lse = torch.empty(query.shape[:2], dtype=torch.float32) if return_lse else None
    return query, torch.empty_like(query), lse


def _check(status: int, query: torch.Tensor) -> None:
    if status != 0:
        dtype = str(query.dtype).removeprefix("torch.")
        raise ValueError(f"the {dtype} attention kernel does not cover {tuple(query.shape)}")
