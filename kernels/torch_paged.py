"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

Caches are per layer, shaped [num_blocks, block_size, num_kv_heads, head_dim]. A token at
position n of a sequence lives in slot `block_table[n // block_size] * block_size + n % block_size`.
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
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(context_len, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


# Decode attention walks the context in chunks small enough to stay in cache, with an online
# softmax (flash-decoding in torch). Sequences are sorted longest first, so a chunk only
# involves the sequences that reach it: no work on padding, and no temporaries so large that
# the allocator maps fresh pages for them on every call.
CHUNK_BYTES = 4 << 20


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim], one query per sequence, at its last position
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    batch, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    lens, order = context_lens.sort(descending=True)
    lens_list = lens.tolist()
    tables = block_tables[order]
    q = query[order].view(batch, kv_heads, group, head_dim)
    m = torch.full((batch, kv_heads, group, 1), float("-inf"), device=query.device)
    denom = torch.zeros((batch, kv_heads, group, 1), device=query.device)
    acc = torch.zeros((batch, kv_heads, group, head_dim), device=query.device)
    bytes_per_token = kv_heads * head_dim * k_cache.element_size()

    start, num_blocks = 0, -(-lens_list[0] // block_size)
    while start < num_blocks:
        # rows still inside their context at this block (lens is sorted, so a prefix)
        rows = sum(1 for n in lens_list if n > start * block_size)
        fit = CHUNK_BYTES // (rows * bytes_per_token * block_size)
        width = max(1, min(num_blocks - start, fit))
        ids = tables[:rows, start : start + width]
        tokens = width * block_size
        k = k_cache[ids].view(rows, tokens, kv_heads, head_dim).permute(0, 2, 3, 1)
        v = v_cache[ids].view(rows, tokens, kv_heads, head_dim).transpose(1, 2)
        scores = torch.matmul(q[:rows], k).float().mul_(scale)  # [rows, kv_heads, group, tokens]
        positions = torch.arange(start * block_size, start * block_size + tokens, device=q.device)
        pad = positions[None, :] >= lens[:rows, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m[:rows], scores.amax(dim=-1, keepdim=True))
        probs = torch.exp(scores - m_new)
        rescale = torch.exp(m[:rows] - m_new)
        denom[:rows] = denom[:rows] * rescale + probs.sum(dim=-1, keepdim=True)
        acc[:rows] = acc[:rows] * rescale + torch.matmul(probs.to(v.dtype), v).float()
        m[:rows] = m_new
        start += width
    out = torch.empty_like(query)
    out[order] = (acc / denom).to(query.dtype).view(batch, heads, head_dim)
    return out


def dense_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The plainest correct decode attention: one sequence at a time. For tests."""
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        slots = gather_slots(block_tables[i], n, k_cache.shape[1])
        k = k_cache.view(-1, *k_cache.shape[2:])[slots].float()  # [n, kv_heads, d]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots].float()
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


def prefill_attention(
    query: torch.Tensor,  # [T, heads, head_dim], the chunks of several sequences back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start: list[int],  # [S + 1]
    context_lens: list[int],  # [S] tokens in the cache after this chunk
    scale: float,
) -> torch.Tensor:
    heads, head_dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(query)
    for i, context_len in enumerate(context_lens):
        start, end = query_start[i], query_start[i + 1]
        q_len = end - start
        slots = gather_slots(block_tables[i], context_len, k_cache.shape[1])
        k = k_flat[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        v = v_flat[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        q = query[start:end].transpose(0, 1)  # [heads, q_len, d]
        # query j sits at absolute position context_len - q_len + j and sees keys 0..that position
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
