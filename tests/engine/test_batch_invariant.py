"""Batch-invariant mode (`--batch-invariant`): a request's tokens and logprobs are bit for bit
the same whether it runs alone or among 63 others, its prompt chunked differently, its prefix
computed by another request or not."""

from __future__ import annotations

import functools

import pytest
import torch

from conveyor.cli.engine_options import add_engine_arguments, engine_config
from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.batch_invariant import (
    GROUP_ROWS,
    PART_TILES,
    ROW_TILE,
    in_row_tiles,
    tiles_for,
)
from conveyor.kernels.metadata import BatchTables
from tests.hf_reference import random_prompts

REQUESTS = 64


def test_products_meet_the_same_shapes_whatever_the_row_count():
    weight = torch.randn(24, 16)
    shapes = []

    def product(rows: torch.Tensor) -> torch.Tensor:
        shapes.append(rows.shape[0])
        # a product whose rows depend on how many there are, as a BLAS library's may
        return rows @ weight.T + rows.shape[0]

    x = torch.randn(ROW_TILE * 2 + 5, 16)
    whole = in_row_tiles(product, x)
    for start, rows in ((0, 1), (3, 7), (40, ROW_TILE + 9)):
        part = in_row_tiles(product, x[start : start + rows])
        assert torch.equal(part, whole[start : start + rows])
    assert set(shapes) == {ROW_TILE}
    assert torch.allclose(whole, x @ weight.T + ROW_TILE)
    # leading dimensions are kept
    assert in_row_tiles(product, x[:6].view(2, 3, 16)).shape == (2, 3, 24)
    # with smaller tiles allowed, the rows left over take the smallest that holds them; with
    # groups allowed, whole groups go first
    shapes.clear()
    in_row_tiles(product, x[: ROW_TILE + 20], (16, 32, ROW_TILE))
    assert shapes == [ROW_TILE, 32]
    shapes.clear()
    in_row_tiles(
        product, torch.randn(GROUP_ROWS * 2 + ROW_TILE + 3, 16), (16, ROW_TILE, GROUP_ROWS)
    )
    assert shapes == [GROUP_ROWS, GROUP_ROWS, ROW_TILE, 16]


def test_a_smaller_tile_is_used_only_where_it_gives_the_same_bits():
    weight = torch.randn(24, 16)
    exact = functools.partial(torch.nn.functional.linear, weight=weight)
    assert tiles_for([(exact, weight.new_empty(1, 16))]) == (*PART_TILES, ROW_TILE, GROUP_ROWS)

    def sums_otherwise_below_32_rows_and_above_64(rows: torch.Tensor) -> torch.Tensor:
        out = rows @ weight.T
        return out if 32 <= rows.shape[0] <= ROW_TILE else out + 1e-6

    products = [
        (exact, weight.new_empty(1, 16)),
        (sums_otherwise_below_32_rows_and_above_64, weight[:1]),
    ]
    assert tiles_for(products) == (32, 48, ROW_TILE)


def test_each_kind_of_projection_is_checked_once_not_once_per_layer(checkpoints, monkeypatch):
    from conveyor.engine.models import layers

    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", batch_invariant=True)
    model = llm.runner.model
    checked = []
    monkeypatch.setattr(layers, "tiles_for", lambda p: checked.append(p) or (ROW_TILE,))
    model.use_batch_invariance()
    projections = [m for m in model.modules() if isinstance(m, layers.Linear)]
    assert len(projections) == 4 * 2  # q/k/v, o, gate/up and down in each of two layers
    assert len(checked) == 4
    assert all(m.row_tiles == (ROW_TILE,) for m in projections)


def test_every_prefill_query_becomes_a_decode_of_its_own():
    # one decode at context 9, then chunks of 3 queries (context 5 -> 8) and 2 (0 -> 2)
    tables = BatchTables([[7, 8]], [9], [[1, 2], [3]], [8, 2], [0, 3, 5])
    rows = tables.every_row_a_decode()
    assert rows.decode_tables == [[7, 8], [1, 2], [1, 2], [1, 2], [3], [3]]
    assert rows.decode_lens == [9, 6, 7, 8, 1, 2]
    assert (rows.prefill_tables, rows.prefill_lens, rows.query_start) == ([], [], [0])


def test_the_flag_and_its_variable_set_it(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args(["--model", "m"])).batch_invariant is False
    args = parser.parse_args(["--model", "m", "--batch-invariant"])
    assert engine_config(args).batch_invariant is True


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """head size 64: the native bfloat16 attention kernels cover it (CPUs with AVX512-BF16)."""
    return write_tiny_model(
        tmp_path_factory.mktemp("bi") / "llama", "llama", hidden_size=256, head_dim=64,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
    )  # fmt: skip


def mixed_params() -> list[SamplingParams]:
    """Greedy requests and seeded sampled ones, all with logprobs."""
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
        if i % 2
        else SamplingParams(
            temperature=1.0, top_p=0.9, seed=i, max_tokens=12, logprobs=3, ignore_eos=True
        )
        for i in range(REQUESTS)
    ]


def outputs_of(results) -> list[tuple]:
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def alone_and_together(path, dtype: str, **engine) -> tuple[list, list, list]:
    """The 64 requests run together; each alone in a fresh engine; each alone again in the
    first engine, where the batch left their prefixes cached."""
    prompts = random_prompts(REQUESTS, 5, 150, seed=7)
    params = mixed_params()

    def llm() -> LLM:
        # a small step budget: the batch's prompts are chunked and share steps with decodes
        return LLM(str(path), dtype=dtype, device="cpu", max_num_batched_tokens=256,
                   batch_invariant=True, **engine)  # fmt: skip

    batch_engine = llm()
    together = batch_engine.generate(prompts, params, use_tqdm=False)
    fresh = llm()
    pairs = list(zip(prompts, params, strict=True))
    alone = [fresh.generate([p], [s], use_tqdm=False)[0] for p, s in pairs]
    cached = [batch_engine.generate([p], [s], use_tqdm=False)[0] for p, s in pairs]
    return outputs_of(together), outputs_of(alone), outputs_of(cached)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_alone_and_together_are_equal_bit_for_bit(wide_llama, dtype):
    together, alone, cached = alone_and_together(wide_llama, dtype)
    assert sum(len(tokens) for tokens, _ in together) == REQUESTS * 12
    assert alone == together  # token ids, and logprob floats compared exactly
    assert cached == together


@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
def test_experts_windows_and_soft_caps_are_batch_invariant(checkpoints, arch):
    """Experts run on the rows routed to them (a count the batch decides); Gemma 2 has a
    sliding window and capped scores, which take other attention paths."""
    together, alone, cached = alone_and_together(checkpoints[arch], "float32")
    assert alone == together
    assert cached == together


def test_the_triton_path_splits_no_context_and_replays_graphs_alike(checkpoints, monkeypatch):
    """The GPU's kernels (under Triton's interpreter here) with decode graphs recorded: every
    decode attention runs unsplit, and requests alone and together agree bit for bit."""
    from conveyor.kernels import triton_paged
    from tests.engine.test_cuda_graphs import replay_by_running_again

    splits = []
    decode = triton_paged.paged_decode_attention

    def spy(*args, num_splits=None, **kwargs):
        splits.append(num_splits)
        return decode(*args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(triton_paged, "paged_decode_attention", spy)
    prompts = random_prompts(6, 3, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)

    def llm() -> LLM:
        engine = LLM(str(checkpoints["qwen3"]), device="cpu", dtype="float32", block_size=8,
                     max_num_seqs=8, max_num_batched_tokens=48, attention_backend="triton",
                     batch_invariant=True)  # fmt: skip
        assert engine.runner.record_graphs(8, engine.max_model_len, replay_by_running_again) is None
        return engine

    together = outputs_of(llm().generate(prompts, params, use_tqdm=False))
    fresh = llm()
    alone = [outputs_of(fresh.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert alone == together
    assert splits and set(splits) == {1}
