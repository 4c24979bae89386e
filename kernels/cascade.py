"""Cascade attention for sequences that share a cached prefix (the CPU/torch path).

When many sequences in a step read the same leading KV blocks (a shared system prompt served
from the prefix cache), attention to that prefix is one matmul of all their queries against
one copy of its keys, instead of a copy of the prefix per sequence. Each sequence's own tail
(the rest of its context) is attended separately, and the two parts are merged by their
log-sum-exp, which is exact.
"""

from __future__ import annotations

import torch

from kernels.torch_paged import gather_context

MIN_SHARED_TOKENS = 64  # below this a shared prefix is not worth the extra pass
MIN_SEQUENCES = 2


def prefix_groups(
    block_tables: torch.Tensor,  # [S, W]
    limits: torch.Tensor,  # [S]: the most prefix tokens each row may share
    block_size: int,
) -> list[tuple[torch.Tensor, int]]:
    """(rows, shared tokens) for each set of rows whose tables start with the same blocks."""
    if block_tables.shape[0] < MIN_SEQUENCES or block_tables.shape[1] == 0:
        return []
    firsts, inverse, counts = torch.unique(
        block_tables[:, 0], return_inverse=True, return_counts=True
    )
    groups = []
    for g in torch.nonzero(counts >= MIN_SEQUENCES).flatten().tolist():
        rows = torch.nonzero(inverse == g).flatten()
        tables = block_tables[rows]
        same = (tables == tables[0]).all(0).int()
        shared_blocks = int(same.cumprod(0).sum())
        shared_blocks = min(shared_blocks, int(limits[rows].min()) // block_size)
        if shared_blocks * block_size >= MIN_SHARED_TOKENS:
            groups.append((rows, shared_blocks * block_size))
    return groups


def _attend(q, k, v, scale: float, mask: torch.Tensor | None = None):
    """Attention with its log-sum-exp: q [..., M, d], k/v [..., N, d]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), v.float())
    return out, lse


def _merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse)


def _shared_part(query, k_cache, v_cache, table, prefix: int, scale: float):
    """Every query against the shared prefix: [T, heads, d] -> out, lse in [kv, T*g, ...]."""
    tokens, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    k = gather_context(k_cache, table, prefix)  # [kv, P, d], one copy for everyone
    v = gather_context(v_cache, table, prefix)
    q = query.view(tokens, kv_heads, group, head_dim).permute(1, 0, 2, 3)
    return _attend(q.reshape(kv_heads, tokens * group, head_dim), k, v, scale)


def _to_tokens(x: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    """[kv, T*g, d] -> [T, heads, d]."""
    kv_heads, _, d = x.shape
    return (
        x.view(kv_heads, tokens, heads // kv_heads, d).permute(1, 0, 2, 3).reshape(tokens, heads, d)
    )


def decode(query, k_cache, v_cache, block_tables, context_lens, scale: float, prefix: int):
    """Decode attention for sequences whose first `prefix` tokens are the same blocks."""
    batch, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out_a, lse_a = _shared_part(query, k_cache, v_cache, block_tables[0], prefix, scale)

    # each sequence's tail: positions prefix .. context_len - 1 (at least one: its own token)
    tail_lens = context_lens - prefix
    first = prefix // block_size
    width = -(-int(tail_lens.max()) // block_size)
    ids = block_tables[:, first : first + width]
    k = k_cache[ids].permute(2, 0, 1, 3, 4).reshape(kv_heads, batch, width * block_size, head_dim)
    v = v_cache[ids].permute(2, 0, 1, 3, 4).reshape(kv_heads, batch, width * block_size, head_dim)
    q = query.view(batch, kv_heads, group, head_dim).transpose(0, 1)  # [kv, B, g, d]
    valid = torch.arange(width * block_size, device=query.device)[None, :] < tail_lens[:, None]
    out_b, lse_b = _attend(q, k, v, scale, valid[None, :, None, :])  # [kv, B, g, ...]
    out_b = out_b.reshape(kv_heads, batch * group, head_dim)
    lse_b = lse_b.reshape(kv_heads, batch * group, 1)
    return _to_tokens(_merge(out_a, lse_a, out_b, lse_b), batch, heads).to(query.dtype)


def prefill(query, k_cache, v_cache, block_tables, query_start, context_lens, scale, prefix):
    """Prefill attention for chunks that all start past a shared `prefix` of the same blocks."""
    tokens, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out_a, lse_a = _shared_part(query, k_cache, v_cache, block_tables[0], prefix, scale)
    out_b = torch.empty_like(out_a)
    lse_b = torch.empty_like(lse_a)
    first = prefix // block_size
    for i, context_len in enumerate(context_lens):
        start, end = query_start[i], query_start[i + 1]
        tail = context_len - prefix
        k = gather_context(k_cache, block_tables[i, first:], tail)  # [kv, tail, d]
        v = gather_context(v_cache, block_tables[i, first:], tail)
        q = query[start:end].view(end - start, kv_heads, group, head_dim).permute(1, 0, 2, 3)
        q = q.reshape(kv_heads, (end - start) * group, head_dim)
        # query j sits at tail position tail - (end - start) + j and sees keys up to it
        q_pos = torch.arange(tail - (end - start), tail, device=query.device)
        q_pos = q_pos.repeat_interleave(group)
        mask = torch.arange(tail, device=query.device)[None, :] <= q_pos[:, None]
        o, lse = _attend(q, k, v, scale, mask[None])
        out_b[:, start * group : end * group] = o
        lse_b[:, start * group : end * group] = lse
    return _to_tokens(_merge(out_a, lse_a, out_b, lse_b), tokens, heads).to(query.dtype)
