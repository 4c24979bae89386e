"""Requests that share a system prompt reuse its cached KV blocks."""

from __future__ import annotations

import torch

from conveyor.engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy


def test_shared_system_prompt_is_computed_once(checkpoints):
    path = checkpoints["qwen3"]
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 512, (200,), generator=g).tolist()
    suffixes = [
        torch.randint(3, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (64,), generator=g)
    ]
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=16)

    first = llm.generate([system + [5, 6, 7]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    before = llm.stats()
    full_blocks = 200 // 16
    assert before.kv_blocks_cached >= full_blocks  # freed, but still cached

    prompts = [system + s for s in suffixes]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats()

    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.num_cached_tokens == full_blocks * 16
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 64 * full_blocks * 16
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert computed == sum(len(p) for p in prompts) - 64 * full_blocks * 16


def test_cache_hit_leaves_one_token_to_compute(checkpoints):
    """A prompt that is entirely cached still computes its last block to get logits."""
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=16)
    prompt = list(range(3, 3 + 64))  # exactly four blocks
    params = SamplingParams(temperature=0, max_tokens=4)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    assert b.num_cached_tokens == 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(path, prompt, 4)


def test_evicted_blocks_are_recomputed_correctly(checkpoints):
    """With a pool too small to keep old prefixes, LRU eviction reuses blocks safely."""
    path = checkpoints["llama"]
    llm = LLM(
        str(path), dtype="float32", device="cpu", block_size=8, num_kv_blocks=20, max_model_len=160
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (100,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=5)
    for prompt in prompts + prompts[:2]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 5)
    assert llm.stats().kv_blocks_used == 0


def test_a_warm_up_leaves_no_trace(checkpoints):
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", block_size=16)
    fresh = llm.stats()
    llm.warm_up()
    assert llm.stats() == fresh
    assert not llm.has_unfinished() and len(llm.block_manager.cached) == 0
