"""Cascade attention: a prefix that many sequences share is read once for all of them.

In a batch of few-shot requests most sequences start with the same cached system prompt. Paged
attention reads those blocks again for every sequence: a small matrix product per sequence
(decode), or a gathered copy per sequence (prefill). Here the queries of all the sequences
that share the prefix attend to it as one large product (torch's fused CPU attention, which
also returns each row's log-sum-exp), each sequence attends to the rest of its own context as
before, and the two partial results merge exactly by their log-sum-exps (the cascade attention
of FlashInfer and vLLM).
"""

from __future__ import annotations

import os

import torch

from conveyor.kernels.metadata import AttentionMetadata, BatchTables, CascadePlan, SharedPrefix

# Below these a prefix is left to the plain path: one more kernel call and a merge cost more
# than reading a few blocks a few times.
MIN_SEQUENCES = 4
MIN_BLOCKS = 4


def plan_cascade(
    slot_mapping: torch.Tensor, batch: BatchTables, block_size: int, device: torch.device
) -> CascadePlan | None:
    """Group the batch's sequences by the blocks their tables start with (a batch lists decodes,
    one query each, then prefill chunks). A group's prefix is the blocks every member's table
    starts with and every member's first query comes after, so each of its queries sees all of
    it and no mask is needed. Runs every step, so a batch with no such prefix (the common case:
    prompts that share less than `MIN_BLOCKS` blocks) is found out cheaply."""
    d, query_start = len(batch.decode_tables), batch.query_start
    tables = batch.decode_tables + batch.prefill_tables
    counts = [1] * d + [b - a for a, b in zip(query_start, query_start[1:], strict=False)]
    lens = batch.decode_lens + batch.prefill_lens
    first_positions = [n - c for n, c in zip(lens, counts, strict=True)]

    groups: dict[int, list[int]] = {}
    least = MIN_BLOCKS * block_size
    for i, table in enumerate(tables):
        if first_positions[i] >= least:
            groups.setdefault(table[0], []).append(i)
    shared = [0] * len(tables)
    prefixes = []
    for members in groups.values():
        if len(members) < MIN_SEQUENCES:
            continue
        whole = min(first_positions[i] for i in members) // block_size
        common = _common_blocks(tables, members, whole)
        if len(common) < MIN_BLOCKS:
            continue
        rows = []
        for i in members:
            shared[i] = len(common)
            first_row = i if i < d else d + query_start[i - d]
            rows.extend(range(first_row, first_row + counts[i]))
        prefixes.append(
            SharedPrefix(
                torch.tensor(common, dtype=torch.long, device=device),
                torch.tensor(rows, dtype=torch.long, device=device),
            )
        )
    if not prefixes:
        return None
    suffix_tables = [table[s:] for table, s in zip(tables, shared, strict=True)]
    suffix_lens = [n - s * block_size for n, s in zip(lens, shared, strict=True)]
    suffix = BatchTables(
        suffix_tables[:d], suffix_lens[:d], suffix_tables[d:], suffix_lens[d:], query_start
    )
    return CascadePlan(prefixes, AttentionMetadata.build(slot_mapping, suffix, device))


def _common_blocks(tables: list[list[int]], members: list[int], whole: int) -> list[int]:
    """The blocks, of the first `whole`, that the tables of all `members` start with; cut
    short (and of no use) once fewer than `MIN_BLOCKS` are left."""
    common = tables[members[0]][:whole]
    for i in members[1:]:
        table = tables[i]
        if table[: len(common)] != common:
            common = os.path.commonprefix([common, table])
            if len(common) < MIN_BLOCKS:
                break
    return common


def merge_prefix(
    out: torch.Tensor,  # [T, heads, head_dim]: attention over each sequence's own part
    lse: torch.Tensor,  # [T, heads] float32: its log-sum-exp
    query: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: SharedPrefix,
    scale: float,
) -> None:
    """Attend `prefix.rows` to the shared blocks and merge that into their rows of `out`."""
    rows = prefix.rows
    num_rows, heads, head_dim = len(rows), query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    k = k_cache[prefix.block_ids].transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
    v = v_cache[prefix.block_ids].transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
    # no mask, so the query heads of one K/V head are just more rows against it
    q = query[rows].view(num_rows, kv_heads, group, head_dim).transpose(0, 1)
    q = q.reshape(1, kv_heads, num_rows * group, head_dim)
    o, o_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    o = o[0].view(kv_heads, num_rows, group, head_dim).transpose(0, 1)
    o = o.reshape(num_rows, heads, head_dim)
    o_lse = o_lse[0].view(kv_heads, num_rows, group).transpose(0, 1).reshape(num_rows, heads)
    own_lse = lse[rows]
    total = torch.logaddexp(o_lse, own_lse)
    w_prefix = torch.exp(o_lse - total)[..., None]
    w_own = torch.exp(own_lse - total)[..., None]
    out[rows] = (o.float() * w_prefix + out[rows].float() * w_own).to(out.dtype)
