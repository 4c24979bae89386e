"""Decode graphs, recorded and replayed: on a GPU by CUDA; here by a capture that replays by
running the recorded function again over the same static buffers, which is what a graph does.
The kernels are the GPU's (Triton, under its interpreter: TRITON_INTERPRET=1 in conftest), so
padded rows are the GPU's too: KV slot -1 and context length 0."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.cuda_graphs import buckets_for
from tests.hf_reference import hf_greedy, random_prompts


def replay_by_running_again(run):
    out = run().clone()

    def replay() -> None:
        out.copy_(run())

    return replay, out


def replay_nothing(run):
    return (lambda: None), run().clone()


def capture_that_fails(run):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(
        str(checkpoints["qwen3"]), device="cpu", dtype="float32", block_size=8,
        max_num_seqs=8, max_num_batched_tokens=48, attention_backend="triton",
    )  # fmt: skip


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets_for(256)[-3:] == [224, 240, 256]


def test_replayed_decode_steps_give_transformers_greedy_tokens(llm, checkpoints):
    """Steps of 1 to 7 sequences (padded to 2, 4 or 8 rows) replay their bucket's graph, and
    the tokens are transformers' own."""
    assert llm.runner.record_graphs(8, llm.max_model_len, replay_by_running_again) is None
    graphs = llm.runner.graphs
    replayed = []
    run = graphs.run
    graphs.run = lambda ids, pos, meta: replayed.append(ids.shape[0]) or run(ids, pos, meta)
    try:
        prompts = random_prompts(7, 3, 30, seed=4)
        max_tokens = [14, 3, 11, 5, 9, 7, 12]
        params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.runner.graphs = None
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(checkpoints["qwen3"], prompt, m)
    assert replayed and {3, 5, 6} & set(replayed)  # sizes between buckets: padded rows


def test_graphs_that_replay_wrongly_are_turned_off_with_the_reason(llm):
    reason = llm.runner.record_graphs(8, llm.max_model_len, replay_nothing)
    assert reason is not None and "differs from the eager one" in reason
    assert llm.runner.graphs is None
    reason = llm.runner.record_graphs(8, llm.max_model_len, capture_that_fails)
    assert (
        reason == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    )
    assert llm.runner.graphs is None


def test_enforce_eager_turns_graphs_off(checkpoints):
    import argparse

    from conveyor.cli.engine_options import add_engine_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config(parser.parse_args(["--model", "m", "--enforce-eager"]))
    assert config.cuda_graphs is False
    assert engine_config(parser.parse_args(["--model", "m"])).cuda_graphs is True
    eager = LLM(str(checkpoints["llama"]), device="cpu", cuda_graphs=False, max_num_seqs=4)
    eager._record_graphs()
    assert eager.plan.graphs == "off (--enforce-eager)" and eager.runner.graphs is None
    assert LLM(str(checkpoints["llama"]), device="cpu", max_num_seqs=4).plan.graphs == "none"


def decode_step(runner, blocks: list[int], position: int):
    """A decode step's inputs: one sequence per block of `blocks`, each at `position`."""
    from conveyor.kernels.metadata import AttentionMetadata, BatchTables

    bs, n = runner.block_size, len(blocks)
    tables = BatchTables([[b] for b in blocks], [position + 1] * n, [], [], [0])
    slots = torch.tensor([b * bs + position for b in blocks])
    meta = AttentionMetadata.build(slots, tables, runner.device)
    return torch.arange(1, n + 1), torch.full((n,), position), meta


def test_padded_rows_write_no_kv_and_read_nothing(llm):
    """After a step of 4 rows, a step of 3 (padded to the same bucket of 4) writes K/V at its
    own 3 slots only: the fourth row's slot from the step before is not written again."""
    runner = llm.runner
    assert runner.record_graphs(8, llm.max_model_len, replay_by_running_again) is None
    try:
        runner.graphs.run(*decode_step(runner, [10, 11, 12, 13], 2))
        before = [k.clone() for k, _ in runner.kv_caches]
        hidden = runner.graphs.run(*decode_step(runner, [20, 21, 22], 2))
        assert hidden.shape[0] == 3 and not torch.isnan(hidden).any()
        for (k, _), old in zip(runner.kv_caches, before, strict=True):
            changed = (k != old).any(dim=(1, 3)).nonzero().tolist()  # [block, offset] pairs
            assert changed == [[20, 2], [21, 2], [22, 2]]
    finally:
        runner.graphs = None


def test_a_hybrid_kv_layout_replays_with_a_table_per_group(checkpoints):
    """Gemma 3's local and global layers keep a block table each (`kv_layout`): the graphs
    hold static tables per group, and replayed steps past the window give transformers'
    tokens."""
    path = checkpoints["gemma3"]
    llm = LLM(
        str(path), device="cpu", dtype="float32", block_size=8, max_num_seqs=4,
        max_num_batched_tokens=64, attention_backend="triton",
    )  # fmt: skip
    assert llm.kv_layout.num_groups == 2
    assert llm.runner.record_graphs(4, llm.max_model_len, replay_by_running_again) is None
    assert len(llm.runner.graphs.static.tables) == 2
    graphs, replayed = llm.runner.graphs, []
    run = graphs.run
    graphs.run = lambda ids, pos, meta: replayed.append(len(meta)) or run(ids, pos, meta)
    prompts = random_prompts(3, 20, 40, seed=8)  # past the 16-token window
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
    assert replayed and set(replayed) == {2}  # one metadata per group
