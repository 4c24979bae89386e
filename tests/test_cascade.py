"""Cascade attention (a shared cached prefix read once for all the sequences that share it)
against the plain kernels, with several groups of sharing sequences and loners in one step."""

from __future__ import annotations

import pytest
import torch

from kernels import TorchPagedAttention, cascade
from kernels import torch_paged as ref

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 8, 2, 4, 32


def shared_tables(groups: list[tuple[int, list[int]]], seed: int = 0):
    """A cache and block tables: for each (prefix blocks, context lens) group, sequences that
    start with the same `prefix blocks` blocks, then blocks of their own."""
    g = torch.Generator().manual_seed(seed)
    need = sum(p + sum(-(-n // BLOCK) for n in lens) for p, lens in groups) + 4
    free = torch.randperm(need, generator=g).tolist()
    rows, lens_all = [], []
    for prefix_blocks, lens in groups:
        prefix = [free.pop() for _ in range(prefix_blocks)]
        for n in lens:
            own = -(-n // BLOCK) - prefix_blocks
            rows.append(prefix + [free.pop() for _ in range(own)])
            lens_all.append(n)
    width = max(map(len, rows))
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    k_cache = torch.randn(need, KV_HEADS, BLOCK, HEAD_DIM, generator=g)
    v_cache = torch.randn(need, KV_HEADS, BLOCK, HEAD_DIM, generator=g)
    return k_cache, v_cache, tables, torch.tensor(lens_all), g


GROUPS = [
    [(10, [81, 95, 120, 81])],  # one group: an 80-token prefix, tails of 1-40 tokens
    [(10, [90, 100]), (12, [97, 200, 130]), (0, [5, 300])],  # two groups and two loners
    [(8, [65, 66])],  # the shortest prefix that counts, tails of 1 and 2 tokens
]


@pytest.mark.parametrize("groups", GROUPS)
def test_cascade_decode_matches_dense(groups) -> None:
    k_cache, v_cache, tables, lens, g = shared_tables(groups)
    found = cascade.prefix_groups(tables, lens - 1, BLOCK)
    assert found, "the test must exercise the cascade path"
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
    got = TorchPagedAttention()._decode(query, k_cache, v_cache, tables, lens, 0.2)
    want = ref.dense_decode_attention(query, k_cache, v_cache, tables, lens, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", GROUPS)
def test_cascade_prefill_matches_the_plain_prefill(groups) -> None:
    k_cache, v_cache, tables, lens, g = shared_tables(groups, seed=1)
    chunks = [min(int(n) - 64, 1 + 7 * i) for i, n in enumerate(lens)]  # past the prefix
    chunks = [max(c, 1) for c in chunks]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c)
    query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=g)
    key = torch.randn(starts[-1], KV_HEADS, HEAD_DIM, generator=g)  # unused: all cached
    context = lens.tolist()
    got = TorchPagedAttention()._prefill(
        query, key, key, k_cache, v_cache, tables, starts, context, 0.2
    )
    want = ref.prefill_attention(query, k_cache, v_cache, tables, starts, context, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_cascade_without_a_long_enough_shared_prefix() -> None:
    _, _, tables, lens, _ = shared_tables([(7, [60, 70]), (0, [9, 9])])
    assert cascade.prefix_groups(tables, lens - 1, BLOCK) == []  # 56 shared tokens < 64
