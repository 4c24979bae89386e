"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

Caches are per layer, shaped [num_blocks, kv_heads, block_size, head_dim]: a block holds each
head's keys for `block_size` consecutive positions as one contiguous [block_size, head_dim]
matrix, so gathered blocks feed batched matmuls without a transposing copy. The token at
position n of a sequence lives in block `block_table[n // block_size]`, row `n % block_size`;
its flat slot number is `block * block_size + n % block_size`.

With a sliding `window` (a layer of Mistral, Qwen2 with `use_sliding_window`, ...) the query at
position p sees the keys at positions p - window + 1 .. p only, as transformers masks them. With
`softcap` (Gemma 2) each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, offsets] = key
    v_cache[blocks, :, offsets] = value


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """One sequence's first `context_len` cached vectors: [kv_heads, context_len, head_dim]."""
    block_size = cache.shape[2]
    blocks = cache[block_table[: -(-context_len // block_size)]]  # [n, kv_heads, bs, d]
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return blocks.transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :context_len]


# Decode attention sorts the sequences by context length and takes them in groups small enough
# that a group's gathered K/V stays in cache; a group is padded only to its own longest context.
GROUP_BYTES = 2 << 20


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim], one query per sequence, at its last position
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its sequence's cache (its last `window` tokens where the
    layer has one, its scores soft-capped where it has `softcap`); with `return_lse` also the
    log-sum-exp of its scaled scores, [B, heads] float32 (for merging partial attentions)."""
    batch, heads, head_dim = query.shape
    num_blocks, kv_heads, block_size = k_cache.shape[:3]
    group = heads // kv_heads
    lens, order = context_lens.sort(descending=True)
    lens_list = lens.tolist()
    tables = block_tables[order]
    q = query[order].view(batch, 1, kv_heads, group, head_dim)
    k_blocks, v_blocks = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    block_bytes = k_blocks.shape[1] * k_cache.element_size()
    out = torch.empty((batch, kv_heads, group, head_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, kv_heads, group), dtype=torch.float32, device=query.device)

    first = 0
    while first < batch:
        width = -(-lens_list[first] // block_size)  # the longest context of this group, in blocks
        rows = max(1, min(batch - first, GROUP_BYTES // (width * block_bytes)))
        last = first + rows
        ids = tables[first:last, :width].reshape(-1)
        shape = (rows, width, kv_heads, block_size, head_dim)
        k = torch.index_select(k_blocks, 0, ids).view(shape)
        v = torch.index_select(v_blocks, 0, ids).view(shape)
        scores = torch.matmul(q[first:last], k.transpose(-1, -2))  # [rows, width, kv, g, bs]
        scores = scores.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, group, width * block_size)
        cols = torch.arange(width * block_size, device=query.device)
        pad = cols >= lens[first:last, None]
        if window is not None:
            pad |= cols < lens[first:last, None] - window
        scores = scores.float().mul_(scale)
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        scores = scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        if return_lse:
            lse[first:last] = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        probs = probs.view(rows, kv_heads, group, width, block_size).permute(0, 3, 1, 2, 4)
        out[first:last] = torch.matmul(probs, v).sum(dim=1)  # sum the blocks' partial outputs
        first = last
    result = torch.empty_like(query)
    result[order] = out.view(batch, heads, head_dim)
    if not return_lse:
        return result
    result_lse = torch.empty_like(lse.view(batch, heads))
    result_lse[order] = lse.view(batch, heads)
    return result, result_lse


def prefill_attention(
    query: torch.Tensor,  # [T, heads, head_dim], the chunks of several sequences back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start: list[int],  # [S + 1]
    context_lens: list[int],  # [S] tokens in the cache after this chunk
    scale: float,
    key: torch.Tensor | None = None,  # [T, kv_heads, head_dim]: this step's keys, if at hand
    value: torch.Tensor | None = None,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's queries over their sequence's cache, causally (and within `window`, the
    scores soft-capped where `softcap`); with
    `return_lse` also the log-sum-exp of each query's scaled scores, [T, heads] float32 (CPU
    only)."""
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    for i, context_len in enumerate(context_lens):
        start, end = query_start[i], query_start[i + 1]
        n = end - start
        plain = window is None and softcap is None
        if key is not None and value is not None and n == context_len and plain:
            # nothing cached before this chunk: attend to its own keys, plain causal
            o, o_lse = _own_keys_attention(
                query[start:end], key[start:end], value[start:end], scale, return_lse
            )
            out[start:end] = o
            if return_lse:
                lse[start:end] = o_lse
            continue
        k = gather_context(k_cache, block_tables[i], context_len)  # [kv_heads, context, d]
        v = gather_context(v_cache, block_tables[i], context_len)
        kv_heads, head_dim = k.shape[0], k.shape[2]
        group = query.shape[1] // kv_heads
        # the query heads that share a K/V head become rows of one matrix against it (no
        # repeated copy of K/V per head); row (token j, head g) sits at position
        # context_len - n + j and sees keys 0..that position
        q = query[start:end].view(n, kv_heads, group, head_dim).transpose(0, 1)
        q = q.reshape(kv_heads, n * group, head_dim)
        q_pos = torch.arange(context_len - n, context_len, device=query.device)
        k_pos = torch.arange(context_len, device=query.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if window is not None:
            mask &= k_pos > q_pos[:, None] - window
        mask = mask.repeat_interleave(group, 0)
        if softcap is None:
            o, o_lse = _sdpa(q, k, v, mask, scale, return_lse)
        else:
            o, o_lse = _capped_attention(q, k, v, mask, scale, softcap)
        out[start:end] = (
            o.view(kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, -1, head_dim)
        )
        if return_lse:
            lse[start:end] = o_lse.view(kv_heads, n, group).transpose(0, 1).reshape(n, -1)
    return (out, lse) if return_lse else out


def _own_keys_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk with nothing cached before it over its own keys, causally: [n, heads, d] and
    the log-sum-exp [n, heads] when asked for."""
    q = query.transpose(0, 1)  # [heads, q_len, d]
    k, v = key.transpose(0, 1), value.transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    if group > 1:  # the fused CPU kernel wants K/V per query head (see _sdpa)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    o, o_lse = _sdpa(q, k, v, None, scale, return_lse)
    return o.transpose(0, 1), None if o_lse is None else o_lse.transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal (mask None) or masked attention of [heads, n, d] inputs, heads equal, and the
    log-sum-exp when asked for.

    A batch dimension is added because that is the form torch's fused CPU attention kernel
    takes; `enable_gqa` or 3-D inputs fall back to a far slower path. The log-sum-exp comes
    from that same kernel, called directly (it wants an additive mask in the query's dtype).
    """
    if not return_lse:
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )
        return out[0], None
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        additive.masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], is_causal=mask is None, attn_mask=additive, scale=scale
    )
    return out[0], lse[0]


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of q [kv_heads, rows, d] over k, v [kv_heads, n, d] with soft-capped
    scores (torch's fused kernel has no cap), and the log-sum-exp."""
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), lse


def dense_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The plainest correct decode attention: one sequence at a time. For tests."""
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        first = 0 if window is None else max(0, n - window)
        k = gather_context(k_cache, block_tables[i], n)[:, first:].float()  # [kv_heads, n, d]
        v = gather_context(v_cache, block_tables[i], n)[:, first:].float()
        group = query.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", query[i].float(), k) * scale
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), v).to(query.dtype)
    return out
