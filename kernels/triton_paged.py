"""Paged attention in Triton: the CUDA path. Attention reads K/V pages in place.

Three kernels, all on caches shaped [num_blocks, kv_heads, block_size, head_dim] (the torch
reference's layout) and addressed through block tables:

- `store_kv`: one program per new token writes its K and V into the slot the slot mapping
  names; slots of -1 (padding) are skipped.
- `paged_decode_attention`: flash-decoding. Stage 1 runs a program per (sequence, KV head,
  split): it walks its share of the context a tile of tokens at a time, maps token n to
  `block_table[n // block_size]`, row `n % block_size`, keeps an online softmax in fp32 for all
  the query heads of that KV head (GQA) and stores a partial output and its log-sum-exp. Stage 2
  merges the splits by log-sum-exp. The split count grows when few sequences would leave the
  GPU's SMs idle; with one split (a big batch) stage 1 writes the output and stage 2 is not
  launched.
- `paged_prefill_attention`: the new tokens of each sequence (ragged, by cumulative offsets)
  attend causally to themselves and to the cached prefix, read through the block table: prefix
  caching and chunked prefill need no copies.

Softmax statistics are fp32 whatever the cache dtype; empty contexts give zeros, never NaN.
Shapes that reach `tl.dot` are padded to at least 16 as the tensor cores want. With
`TRITON_INTERPRET=1` the kernels run on the CPU (slowly), which is how the tests check them.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

# tokens per tile of the context loop; at least 16 for tl.dot
DECODE_BLOCK_N = 64
# the decode kernel's launch: warps per program, and stages of its loads' software pipeline
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
PREFILL_BLOCK_M = 16
PREFILL_BLOCK_N = 64
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the merge than it saves


def _p2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Whether the dots run on fp32 operands: always in the CPU interpreter, whose tl.dot
    mishandles bf16/fp16 operands; on the GPU only for fp32 caches."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_co,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    H_P2: tl.constexpr, D_P2: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM) & ((h * 0 + slot) >= 0)  # padding slots: -1
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + h * stride_ch + offset * stride_co + d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], -1 for padding
) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _check_cache(k_cache, v_cache)
    with on_device(key.device):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2],
            H_P2=_p2(kv_heads), D_P2=_p2(head_dim),
        )  # fmt: skip


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, table, n, valid, kvh, d, d_mask,
    stride_cb, stride_ch, stride_co,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """K and V of context tokens `n` of one KV head, read in place through the block table."""
    page = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = page * stride_cb + kvh * stride_ch + (n % BLOCK_SIZE) * stride_co
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), tanh from one exp of a non-positive number (no overflow)."""
    x = s / cap
    t = tl.exp(-2.0 * tl.abs(x))
    return cap * tl.where(x >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of scores `s` [rows, tokens] and values `v` into the running max `m_i`,
    sum `l_i` and output `acc` (fp32). A row whose scores are all -inf so far stays empty."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# decode

NO_WINDOW = 1 << 30  # a window no context reaches: the kernels' "attend to everything"


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    part_out_ptr, part_lse_ptr, scale, num_splits, window, softcap,
    stride_qb, stride_qh, stride_tb,
    stride_cb, stride_ch, stride_co,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    G_P2: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, DIRECT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b).to(tl.int32)
    first = tl.maximum(context_len - window, 0)  # the window's first position (0: no window)
    split_len = tl.cdiv(tl.cdiv(context_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, G_P2)
    d = tl.arange(0, D_P2)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D_P2], tl.float32)
    table = block_tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, n, valid, kvh, d, d_mask,
            stride_cb, stride_ch, stride_co, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    part = part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    if DIRECT:  # one split: `part_out` is the output itself, nothing to merge
        tl.store(part + d[None, :], out.to(part_out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])  # fmt: skip
    else:
        lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
        tl.store(part + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, S_P2: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_P2)
    d = tl.arange(0, D_P2)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask,
                  other=float("-inf"))  # fmt: skip
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    w = tl.exp(lse - m)
    parts = tl.load(
        part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)  # fmt: skip


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the *current* CUDA device and its stream: a worker on cuda:1, or an
    engine stepped from a thread that never set its device, would otherwise launch against
    device 0 with pointers into device 1."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few, so that splitting is exercised


def choose_num_splits(batch: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Splits per sequence: enough programs to fill the SMs about twice, none shorter than
    MIN_SPLIT_TOKENS. A big batch gets 1 (plain paged attention)."""
    by_length = max(1, max_context_len // MIN_SPLIT_TOKENS)
    wanted = -(-2 * num_sms // max(1, batch * kv_heads))
    return max(1, min(by_length, wanted, 64))


def split_counts_to_warm(most: int) -> list[int]:
    """One split count per compiled variant of the decode kernels that a step choosing at most
    `most` splits can meet: the merge kernel is compiled per power of two of the count
    (`S_P2`), and Triton specialises an integer argument equal to 1 or divisible by 16."""
    first: dict[tuple[int, bool, bool], int] = {}
    for n in range(1, most + 1):
        first.setdefault((_p2(n), n == 1, n % 16 == 0), n)
    return sorted(first.values())


# a block-table width of each kind Triton compiles apart: 1, neither 1 nor a multiple of 16,
# a multiple of 16
TABLE_WIDTHS_TO_WARM = (1, 2, 16)


def warm_up(
    k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, max_context_len: int,
    softcap: float | None = None,
) -> None:  # fmt: skip
    """Compile now every variant the decode and prefill kernels can meet with this cache,
    instead of in the middle of live traffic: each split count of `split_counts_to_warm` and
    each of `TABLE_WIDTHS_TO_WARM` (Triton keys an integer argument, here the table's row
    stride, as 1, a multiple of 16, or neither), with the model's score cap where it has one.
    One query over the cache's first block each; the outputs are thrown away."""
    device, dtype = k_cache.device, k_cache.dtype
    head_dim = k_cache.shape[3]
    most = choose_num_splits(1, 1, max_context_len, _num_sms(device))
    query = torch.zeros((1, heads, head_dim), dtype=dtype, device=device)
    one = torch.ones(1, dtype=torch.long, device=device)
    starts = torch.tensor([0, 1], dtype=torch.long, device=device)
    for width in TABLE_WIDTHS_TO_WARM:
        tables = torch.zeros((1, width), dtype=torch.long, device=device)
        for splits in split_counts_to_warm(most):
            paged_decode_attention(query, k_cache, v_cache, tables, one, 1.0, num_splits=splits,
                                   softcap=softcap)  # fmt: skip
        paged_prefill_attention(query, k_cache, v_cache, tables, starts, one, 1.0, max_query_len=1,
                                softcap=softcap)  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each query over its sequence's cache, or over its last `window` tokens;
    its scores soft-capped at `softcap` where given."""
    batch, heads, head_dim = query.shape
    kv_heads, block_size = _check_cache(k_cache, v_cache, heads)
    out = torch.empty_like(query) if out is None else out
    if batch == 0:
        return out
    query = _last_dim_contiguous(query)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())  # a host sync: pass it when known
        num_splits = choose_num_splits(batch, kv_heads, max_context_len, _num_sms(query.device))
    group = heads // kv_heads
    direct = num_splits == 1
    if direct:  # the split kernel writes `out` (as [B, heads, 1, head_dim]); no merge
        part_out, part_lse = out.unsqueeze(2), out.new_empty((0, 0, 0), dtype=torch.float32)
    else:
        part_out = torch.empty(
            (batch, heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32,
                               device=query.device)  # fmt: skip
    with on_device(query.device):
        _decode_split_kernel[(batch, kv_heads, num_splits)](
            query, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale,
            num_splits, NO_WINDOW if window is None else window, softcap or 0.0,
            query.stride(0), query.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            G_P2=_p2(group, 16), D_P2=_p2(head_dim, 16), BLOCK_N=DECODE_BLOCK_N,
            PRECISION=_precision(query.dtype), DOT_FP32=_dot_fp32(query.dtype), DIRECT=direct,
            SOFTCAP=softcap is not None, num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES,
        )  # fmt: skip
    if direct:
        return out
    with on_device(query.device):
        _decode_merge_kernel[(batch, heads)](
            out, part_out, part_lse, num_splits,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, D_P2=_p2(head_dim), S_P2=_p2(num_splits),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# prefill


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr,
    context_lens_ptr, scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
    stride_cb, stride_ch, stride_co,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(query_start_ptr + i).to(tl.int32)
    q_len = tl.load(query_start_ptr + i + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens_ptr + i).to(tl.int32)

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P2)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_pos = context_len - q_len + m  # absolute position of each query
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    # keys up to this tile's last query position; nothing for a tile past the queries
    hi = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    # and from the first key this tile's first query sees within the window
    lo = tl.maximum(context_len - q_len + tile * BLOCK_M - window + 1, 0)
    lo = lo // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    table = block_tables_ptr + i * stride_tb
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, n, valid, kvh, d, d_mask,
            stride_cb, stride_ch, stride_co, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        seen = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid[None, :] & seen, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,  # [T, heads, head_dim]: the new tokens of all sequences, back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start: torch.Tensor,  # [S + 1] cumulative query offsets
    context_lens: torch.Tensor,  # [S] tokens in the cache after this chunk (incl. new ones)
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each chunk's queries over their sequence's cache, causally (and within `window`; the
    scores soft-capped at `softcap` where given)."""
    num_tokens, heads, head_dim = query.shape
    kv_heads, block_size = _check_cache(k_cache, v_cache, heads)
    out = torch.empty_like(query) if out is None else out
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = _last_dim_contiguous(query)
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())  # a host sync
    grid = (triton.cdiv(max_query_len, PREFILL_BLOCK_M), num_seqs, heads)
    with on_device(query.device):
        _prefill_kernel[grid](
            query, k_cache, v_cache, out, block_tables, query_start, context_lens, scale,
            NO_WINDOW if window is None else window, softcap or 0.0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            D_P2=_p2(head_dim, 16), BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
            PRECISION=_precision(query.dtype), DOT_FP32=_dot_fp32(query.dtype),
            SOFTCAP=softcap is not None,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int | None = None
) -> tuple[int, int]:
    """The caches' (kv_heads, block_size), once they are seen to fit each other (and `heads`
    query heads, when given)."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("the K and V caches must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if heads is not None and heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    return kv_heads, block_size


__all__ = [
    "choose_num_splits",
    "split_counts_to_warm",
    "warm_up",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
]
