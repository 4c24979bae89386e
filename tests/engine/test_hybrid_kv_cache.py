"""The hybrid KV cache: a model mixing sliding-window and global layers keeps a block table per
layer group, and its windowed groups give back the blocks they no longer read.

Gemma 3's pattern (5 local layers to 1 global) then holds at least twice the concurrent context
of a full-attention cache of the same bytes, with outputs still transformers' token for token,
through preemption and prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.demo_model import write_tiny_model
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.block_manager import NULL_BLOCK, BlockManager
from conveyor.engine.kv_layout import KVLayout
from conveyor.engine.sequence import Request, Sequence
from tests.hf_reference import hf_greedy, random_prompts

WINDOW = 16
GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def test_gemma3_layers_make_one_global_group_and_local_groups_of_its_size():
    # Gemma-3-1B: 26 layers, every sixth global
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = KVLayout.of(windows)
    assert layout.num_slots == 4  # its 4 global layers
    assert layout.windows == (None,) + (512,) * 6  # 22 local layers in groups of 4
    assert [layout.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [layout.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    local = [i for i in range(26) if i % 6 != 5]
    assert [layout.layer_group[i] for i in local[:5]] == [1, 1, 1, 1, 2]
    # no two layers of one group share a cache tensor
    pairs = {(g, s) for g, s in zip(layout.layer_group, layout.layer_slot, strict=True)}
    assert len(pairs) == 26
    # a token past the window costs only the global layers
    assert layout.context_token_bytes(100) == 4 * 100


def test_alike_layers_and_the_switch_off_keep_one_group():
    assert KVLayout.of([None] * 4) == KVLayout.single([None] * 4)
    assert KVLayout.of([8, 8]).windows == (8,)
    off = KVLayout.of([None, 8, None, 8], hybrid=False)
    assert off.windows == (None,) and off.num_slots == 4
    assert off.context_token_bytes(100) == 400


def seq_of(ids: list[int]) -> Sequence:
    return Sequence(Request("r", None, ids, SamplingParams()), 0, list(ids), len(ids))


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    assert bm.reserve(seq, n)
    seq.num_computed_tokens += n
    bm.register_computed_blocks(seq)
    bm.release_outside_window(seq)


def test_a_prefix_hit_needs_only_the_windowed_blocks_its_first_token_sees():
    bm = BlockManager(32, 4, windows=(None, 6))
    ids = list(range(1, 21))
    first = seq_of(ids)
    bm.admit(first, bm.match_prefix(first))
    compute(bm, first, 20)
    assert first.tables[1][:3] == [NULL_BLOCK] * 3  # before the window of position 20
    bm.free(first)
    # the windowed group's early blocks go from the cache as the pool needs them
    taker = seq_of([99] * 32)
    bm.admit(taker, [])
    # 12 blocks in each group: the 21 blocks never used, then the 3 given back first
    assert bm.reserve(taker, 48)
    hit = bm.match_prefix(seq_of(ids + [7]))
    assert len(hit) == 5  # every block, though the windowed group lost its first three
    assert hit.released == [0, 3]
    assert hit.tables[1][:3] == [NULL_BLOCK] * 3
    assert all(b != NULL_BLOCK for b in hit.tables[0])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 with its 5:1 pattern of local and global layers."""
    root = tmp_path_factory.mktemp("hybrid")
    return write_tiny_model(
        root / "gemma3", "gemma3", num_hidden_layers=6, layer_types=GEMMA3_TYPES,
        sliding_window=WINDOW,
    )  # fmt: skip


def peak_context(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, list]:
    """The most tokens of context the running sequences held at once, and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, params)
    peak, done = 0, {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        peak = max(peak, sum(seq.num_computed_tokens for seq in llm.scheduler.running))
    return peak, [done[i] for i in range(len(prompts))]


def test_gemma3_holds_twice_the_context_in_the_same_bytes_and_stays_exact(gemma3):
    prompts = random_prompts(12, 60, 90, seed=3)
    bytes_ = 2 * 6 * 16 * 1 * 32 * 4 * 40  # 40 blocks of 16 tokens of a full cache (float32)
    options = dict(device="cpu", dtype="float32", kv_cache_memory=bytes_, max_model_len=320)
    full = LLM(str(gemma3), hybrid_kv_cache=False, **options)
    hybrid = LLM(str(gemma3), **options)
    assert full.kv_layout.num_groups == 1 and hybrid.kv_layout.num_groups == 6
    assert hybrid.stats().kv_bytes_per_token * 6 == full.stats().kv_bytes_per_token
    full_peak, full_out = peak_context(full, prompts, 200)
    hybrid_peak, hybrid_out = peak_context(hybrid, prompts, 200)
    assert hybrid_peak >= 2 * full_peak, (hybrid_peak, full_peak)
    assert full.stats().num_preemptions > 0 and hybrid.stats().num_preemptions > 0
    assert hybrid_out == full_out
    for prompt, got in list(zip(prompts, hybrid_out, strict=True))[:3]:
        want = hf_greedy(gemma3, prompt, 200)  # it stops at EOS, where ours goes on
        assert got[: len(want)] == want
    assert hybrid.stats().kv_blocks_used == 0


def test_gemma3_prefix_hits_past_the_window_stay_exact(gemma3):
    llm = LLM(str(gemma3), device="cpu", dtype="float32", block_size=8)
    stem = random_prompts(2, 80, 80, seed=5)[0]
    llm.generate([stem + [5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prompts = [stem + tail for tail in random_prompts(4, 3, 20, seed=6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert llm.stats().prompt_tokens_cached >= 4 * 72
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(gemma3, prompt, 30)
