"""Cascade attention (kernels.cascade): which sequences a step groups by their shared leading
blocks, and that reading a shared prefix once for a group gives the same attention as reading
it per sequence, through both CPU backends."""

from __future__ import annotations

import os
import random

import pytest
import torch

from conveyor.kernels import AttentionMetadata, get_attention_backend
from conveyor.kernels import cascade as cascade_mod
from conveyor.kernels.cascade import plan_cascade
from conveyor.kernels.metadata import BatchTables
from tests.hf_reference import assert_greedy_matches_hf_through

BS = 8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # the compiled tests' shape: no second compile


def test_plan_groups_sequences_that_start_with_the_same_blocks() -> None:
    shared = [10, 11, 12, 13, 14, 15]
    decode_tables = [shared + [20], shared + [21, 22], shared + [23], [30, 31, 32, 33, 34, 35]]
    decode_lens = [7 * BS, 7 * BS + 3, 6 * BS + 1, 6 * BS]
    prefill_tables = [
        shared + [40, 41],  # a chunk after the shared blocks: all of them usable
        shared[:5] + [50, 51],  # diverges after five blocks
        shared + [60],  # its chunk starts inside block 5, so only blocks 0-4 are before it
    ]
    chunk_lens = [9, 4, 6]
    prefill_lens = [8 * BS, 7 * BS, 5 * BS + 6]
    query_start = [0, 9, 13, 19]
    plan = plan_cascade(
        torch.zeros(23, dtype=torch.long),
        BatchTables(decode_tables, decode_lens, prefill_tables, prefill_lens, query_start),
        BS,
        torch.device("cpu"),
    )
    assert plan is not None and len(plan.prefixes) == 1
    (prefix,) = plan.prefixes
    assert prefix.block_ids.tolist() == shared[:5]
    # rows: decodes 0-2 (not 3, its table starts elsewhere), then the three chunks' rows
    assert prefix.rows.tolist() == [0, 1, 2, *range(4, 4 + sum(chunk_lens))]
    suffix = plan.suffix
    assert suffix.decode_block_tables[:, :3].tolist() == [
        [15, 20, 0],
        [15, 21, 22],
        [15, 23, 0],
        [30, 31, 32],
    ]
    assert suffix.decode_context_lens.tolist() == [2 * BS, 2 * BS + 3, BS + 1, 6 * BS]
    assert [t[: len(t) - t.count(0)] for t in suffix.prefill_block_tables.tolist()] == [
        [15, 40, 41],
        [50, 51],
        [15, 60],
    ]
    assert suffix.prefill_context_lens == [3 * BS, 2 * BS, 6]
    assert suffix.prefill_query_start == query_start


def test_plan_leaves_small_groups_and_short_prefixes_alone() -> None:
    few = [[1, 2, 3, 4, 5, 9 + i] for i in range(cascade_mod.MIN_SEQUENCES - 1)]
    short = [[7, 8, 9, 20 + i] for i in range(cascade_mod.MIN_SEQUENCES)]
    tables = few + short
    lens = [6 * BS] * len(few) + [4 * BS] * len(short)
    plan = plan_cascade(
        torch.zeros(len(tables), dtype=torch.long),
        BatchTables(tables, lens, [], [], [0]),
        BS,
        torch.device("cpu"),
    )
    assert plan is None


def test_common_blocks_are_the_common_prefix_where_it_is_of_use() -> None:
    """The early cut-off gives the tables' common prefix whenever that prefix is long enough to
    share, and something too short to share whenever it is not."""
    rng = random.Random(0)
    for _ in range(500):
        base = [rng.randrange(100) for _ in range(8)]
        tables = [
            base[: rng.choice([1, 2, 4, 5, 8])] + [100 + rng.randrange(5) for _ in range(3)]
            for _ in range(rng.randrange(2, 9))
        ]
        members = list(range(len(tables)))
        whole = rng.randrange(1, 9)
        expected = os.path.commonprefix([t[:whole] for t in tables])
        got = cascade_mod._common_blocks(tables, members, whole)
        if len(expected) >= cascade_mod.MIN_BLOCKS:
            assert got == expected
        else:
            assert len(got) < cascade_mod.MIN_BLOCKS


def _step(lens_and_chunks, prefix_blocks: int, seed: int):
    """A cache holding `prefix_blocks` shared blocks, and one step's sequences: (context length
    after this step, queries this step, shares the prefix). Decodes (1 query) come first."""
    g = torch.Generator().manual_seed(seed)
    total = prefix_blocks + sum(-(-n // BS) for n, _, _ in lens_and_chunks) + 2
    k_cache = torch.randn(total, KV_HEADS, BS, HEAD_DIM, generator=g)
    v_cache = torch.randn(total, KV_HEADS, BS, HEAD_DIM, generator=g)
    free = torch.randperm(total, generator=g).tolist()
    prefix = [free.pop() for _ in range(prefix_blocks)]
    tables = []
    for n, _, shares in lens_and_chunks:
        own = prefix if shares else []
        tables.append(own + [free.pop() for _ in range(-(-n // BS) - len(own))])
    decodes = [i for i, (_, q, _) in enumerate(lens_and_chunks) if q == 1]
    prefills = [i for i, (_, q, _) in enumerate(lens_and_chunks) if q > 1]
    assert decodes == list(range(len(decodes))), "decodes first"
    query_start = [0]
    for i in prefills:
        query_start.append(query_start[-1] + lens_and_chunks[i][1])
    slots = [
        tables[i][p // BS] * BS + p % BS
        for i in decodes + prefills
        for p in range(lens_and_chunks[i][0] - lens_and_chunks[i][1], lens_and_chunks[i][0])
    ]
    num_tokens = len(slots)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    value = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    batch = BatchTables(
        [tables[i] for i in decodes],
        [lens_and_chunks[i][0] for i in decodes],
        [tables[i] for i in prefills],
        [lens_and_chunks[i][0] for i in prefills],
        query_start,
    )
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata.build(slot_mapping, batch, torch.device("cpu"))
    plan = plan_cascade(slot_mapping, batch, BS, torch.device("cpu"))
    return query, key, value, k_cache, v_cache, meta, plan


@pytest.mark.parametrize("backend_name", ["torch", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_gives_the_attention_of_the_plain_path(backend_name, dtype) -> None:
    step = [
        (6 * BS + 3, 1, True),  # decodes of sequences that share the prefix
        (9 * BS, 1, True),
        (5 * BS + 1, 1, True),
        (40, 1, False),  # one that does not
        (7 * BS + 5, 2 * BS + 5, True),  # a chunk that is all its sequence has past the prefix
        (8 * BS + 2, 11, True),  # a chunk after cached tokens of its own
        (30, 30, False),  # a prompt with nothing cached
    ]
    query, key, value, k_cache, v_cache, meta, plan = _step(step, prefix_blocks=5, seed=3)
    assert plan is not None and len(plan.prefixes) == 1
    assert len(plan.prefixes[0].rows) == 3 + 2 * BS + 5 + 11
    backend = get_attention_backend(backend_name, torch.device("cpu"))
    args = [t.to(dtype) for t in (query, key, value, k_cache, v_cache)]
    plain = backend.forward(*args, meta, 0.2)
    meta.cascade = plan
    got = backend.forward(*args, meta, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend_name", ["torch", "compiled"])
def test_log_sum_exps_of_the_plain_paths(backend_name) -> None:
    """The merge's inputs: each path's log-sum-exp is that of its scaled scores."""
    step = [(3 * BS + 2, 1, False), (17, 1, False), (2 * BS, 5, False), (9, 9, False)]
    query, key, value, k_cache, v_cache, meta, _ = _step(step, prefix_blocks=0, seed=4)
    backend = get_attention_backend(backend_name, torch.device("cpu"))
    torch_paged_write = backend.forward(query, key, value, k_cache, v_cache, meta, 0.3)
    out, lse = backend._attend(query, key, value, k_cache, v_cache, meta, 0.3, True)
    torch.testing.assert_close(out, torch_paged_write)
    rows = 0
    for i, (n, q_len, _) in enumerate(step):
        if q_len == 1:
            table = meta.decode_block_tables[i]
        else:
            table = meta.prefill_block_tables[i - meta.num_decode_tokens]
        k = torch.stack([k_cache[table[p // BS], :, p % BS] for p in range(n)])  # [n, kv, d]
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        for j in range(q_len):
            pos = n - q_len + j
            scores = torch.einsum("hd,nhd->hn", query[rows + j], k[: pos + 1]) * 0.3
            torch.testing.assert_close(lse[rows + j], scores.logsumexp(-1))
        rows += q_len


def test_engine_greedy_matches_transformers_through_the_torch_backend(checkpoints) -> None:
    assert_greedy_matches_hf_through(checkpoints["llama"], "torch", seed=9)
