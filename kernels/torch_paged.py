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


def decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim], one query per sequence, at its last position
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    max_len = block_tables.shape[1] * k_cache.shape[1]
    # [B, max_blocks, block_size, kv_heads, d] -> [B, kv_heads, d, L] / [B, kv_heads, L, d]
    keys = k_cache[block_tables].view(batch, max_len, kv_heads, head_dim).permute(0, 2, 3, 1)
    values = v_cache[block_tables].view(batch, max_len, kv_heads, head_dim).transpose(1, 2)
    q = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(q, keys).float() * scale  # [B, kv_heads, group, L]
    positions = torch.arange(max_len, device=query.device)
    pad = positions[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, heads, head_dim)


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
