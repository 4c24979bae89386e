"""The compiled CPU decode attention (`attention_backend="compiled"`) against the plainest
implementation, and the engine's greedy equality with transformers through it. Everything
here uses one model shape (4 heads, 2 KV heads, head size 32, blocks of 8), so inductor
compiles once for the whole file."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from conveyor.kernels import compiled_paged, get_attention_backend
from conveyor.kernels import torch_paged as ref
from tests.hf_reference import assert_greedy_matches_hf_through
from tests.kernels.test_kernels import paged_setup

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 8


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "lens",
    [
        [1, 17, 300, 5, 64, 129, 2, 33],
        [1],  # one sequence of one token
        [8, 16, 24],  # whole blocks only
        [7, 9, 15, 1000],  # a long one beside short ones
        [3] * 40,
    ],
)
def test_compiled_decode_matches_dense(lens: list[int]) -> None:
    k_cache, v_cache, tables, g = paged_setup(lens, BLOCK, KV_HEADS, HEAD_DIM, seed=len(lens))
    tables = torch.cat([tables, torch.zeros(len(lens), 3, dtype=tables.dtype)], 1)  # spare cols
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
    context = torch.tensor(lens)
    got = compiled_paged.decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    want = ref.dense_decode_attention(query, k_cache, v_cache, tables, context, 0.17)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_few_long_contexts_run_apart_from_many_short_ones() -> None:
    blocks = torch.tensor([3, 70, 4, 2, 3, 72, 4, 3])
    short, long = compiled_paged.split_by_width(blocks)
    assert sorted(short.tolist()) == [0, 2, 3, 4, 6, 7] and sorted(long.tolist()) == [1, 5]
    assert compiled_paged.split_by_width(torch.tensor([5, 6, 5, 7])) is None  # nothing to save
    assert compiled_paged.split_by_width(torch.tensor([9])) is None


def test_new_batch_sizes_and_widths_do_not_recompile() -> None:
    def call(lens: list[int], table_dtype: torch.dtype) -> None:
        k_cache, v_cache, tables, g = paged_setup(lens, BLOCK, KV_HEADS, HEAD_DIM)
        query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
        compiled_paged.decode_attention(
            query, k_cache, v_cache, tables.to(table_dtype), torch.tensor(lens), 0.2
        )

    call([5, 9], torch.int64)  # compiled (or already compiled by the test above)
    before = graphs()
    for lens, dtype in (
        ([1], torch.int32),
        ([400] * 3, torch.int64),
        (list(range(1, 90)), torch.int32),
    ):
        call(lens, dtype)
    assert graphs() == before


def test_engine_greedy_matches_transformers_through_the_compiled_backend(checkpoints) -> None:
    assert BLOCK == 8  # the block size the shared check uses: one compile for this file
    assert_greedy_matches_hf_through(checkpoints["qwen3"], "compiled", seed=5)


def test_compiled_backend_is_for_the_cpu_and_needs_a_compiler(monkeypatch) -> None:
    with pytest.raises(ValueError, match="for the CPU"):
        get_attention_backend("compiled", torch.device("cuda"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        get_attention_backend("compiled", torch.device("cpu"))
