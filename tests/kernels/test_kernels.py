"""The paged-attention kernels against the plainest possible implementations."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import torch_paged


def paged_setup(lens, block_size, kv_heads, head_dim, seed=0, dtype=torch.float32):
    """A cache with random contents and a shuffled block table per sequence."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(k)] for k in need]
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return k_cache, v_cache, block_tables, g


def poison_past_contexts(k_cache, v_cache, tables, lens, block_size=16) -> None:
    """NaN in K and infinity in V in each sequence's last block past its context (a pool's
    stale or unwritten rows), which no kernel may let into its results."""
    for b, n in enumerate(lens):
        last = tables[b, (n - 1) // block_size]
        for cache, poison in ((k_cache, float("nan")), (v_cache, float("inf"))):
            cache[last, :, n % block_size or block_size :] = poison


def on_thread_counts(run, counts=(1, 2, 3)) -> dict:
    """`run()`'s result with torch's thread count set to each of `counts` (a kernel's threads
    are torch's), keyed by the count; torch's own count restored after."""
    threads, results = torch.get_num_threads(), {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            results[n] = run()
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("group_bytes", [256, 64 << 10, 4 << 20])
def test_decode_attention_matches_dense(monkeypatch, block_size, heads, kv_heads, group_bytes):
    monkeypatch.setattr(torch_paged, "GROUP_BYTES", group_bytes)  # 256: one sequence a group
    lens = [1, 17, 300, 5, 64, 129, 2, 33]
    k_cache, v_cache, tables, g = paged_setup(lens, block_size, kv_heads, 32)
    query = torch.randn(len(lens), heads, 32, generator=g)
    context = torch.tensor(lens)
    got = torch_paged.decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    want = torch_paged.dense_decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_bfloat16():
    lens = [40, 7, 90]
    k_cache, v_cache, tables, g = paged_setup(lens, 16, 2, 64, dtype=torch.bfloat16)
    query = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)
    context = torch.tensor(lens)
    got = torch_paged.decode_attention(query, k_cache, v_cache, tables, context, 0.125)
    want = torch_paged.dense_decode_attention(query, k_cache, v_cache, tables, context, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_prefill_attention_matches_causal_attention(block_size, pass_new_kv):
    """Chunks that start after a cached prefix see that prefix and themselves, causally."""
    heads, kv_heads, d = 8, 2, 16
    lens = [23, 70, 5]  # full context per sequence
    q_lens = [23, 9, 1]  # the last q_len positions are this step's queries
    k_cache, v_cache, tables, g = paged_setup(lens, block_size, kv_heads, d, seed=1)
    query = torch.randn(sum(q_lens), heads, d, generator=g)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    # this step's keys, as the model passes them: the last q_len cached positions of each
    new_k = torch.cat(
        [
            _positions(k_cache, tables[i], n)[n - m :]
            for i, (n, m) in enumerate(zip(lens, q_lens, strict=True))
        ]
    )
    new_v = torch.cat(
        [
            _positions(v_cache, tables[i], n)[n - m :]
            for i, (n, m) in enumerate(zip(lens, q_lens, strict=True))
        ]
    )
    extra = {"key": new_k, "value": new_v} if pass_new_kv else {}
    got = torch_paged.prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.25, **extra
    )

    for i, (n, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        k = _positions(k_cache, tables[i], n).repeat_interleave(heads // kv_heads, dim=1)
        v = _positions(v_cache, tables[i], n).repeat_interleave(heads // kv_heads, dim=1)
        for j in range(q_len):
            pos = n - q_len + j
            q = query[starts[i] + j]  # [heads, d]
            scores = torch.einsum("hd,nhd->hn", q, k[: pos + 1]) * 0.25
            want = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[: pos + 1])
            torch.testing.assert_close(got[starts[i] + j], want, rtol=1e-5, atol=1e-5)


def _positions(cache, table, n):
    """[n, kv_heads, d]: position p read the slow way, block table entry by entry."""
    bs = cache.shape[2]
    return torch.stack([cache[table[p // bs], :, p % bs] for p in range(n)])


def test_write_kv_goes_to_the_mapped_slots():
    k_cache = torch.zeros(4, 2, 2, 3)  # 4 blocks, 2 kv heads, block size 2, head dim 3
    v_cache = torch.zeros(4, 2, 2, 3)
    key = torch.arange(1, 19, dtype=torch.float).view(3, 2, 3)
    torch_paged.write_kv(key, -key, k_cache, v_cache, torch.tensor([5, 0, 7]))
    assert torch.equal(k_cache[2, :, 1], key[0]) and torch.equal(k_cache[0, :, 0], key[1])
    assert torch.equal(v_cache[3, :, 1], -key[2])
    assert k_cache.abs().sum() == key.abs().sum()
