"""Scoring keeps the prefix cache: prompt logprobs of cached blocks come from the cache, equal to
what caching off computes, and count as cached tokens."""

from __future__ import annotations

import pytest

from conveyor.engine import LLM, SamplingParams
from tests.hf_reference import hf_logprobs, random_prompts

BLOCK = 8


def scoring_prompts(seed: int, questions: int = 6, choices: int = 4) -> list[list[int]]:
    """An MMLU-shaped job: one few-shot prefix, then each question with each choice."""
    prefix = random_prompts(2, 60, 60, seed=seed)[0]
    asked = random_prompts(questions, 5, 14, seed=seed + 1)
    answers = random_prompts(choices, 1, 3, seed=seed + 2)
    return [prefix + q + a for q in asked for a in answers]


def score(llm: LLM, prompts: list[list[int]], k: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return llm.generate(prompts, params, use_tqdm=False)


def engine(path, caching: bool, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
    return LLM(str(path), enable_prefix_caching=caching, **{**options, **kwargs})


def assert_same_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        pairs = zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
        for pos, (x, y) in enumerate(pairs, 1):
            assert x.keys() == y.keys(), pos
            for token in x:
                assert abs(x[token] - y[token]) < 1e-5, (pos, token, x[token], y[token])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_prompt_logprobs_equal_caching_off(checkpoints, arch):
    path = checkpoints[arch]
    prompts = scoring_prompts(seed=3)
    off = score(engine(path, caching=False), prompts, k=1)
    cached = engine(path, caching=True)
    on = score(cached, prompts, k=1)
    assert_same_logprobs(on, off)
    assert all(o.num_cached_tokens == 0 for o in off)
    # all but the first computations of the shared prefix come from the cache
    served = sum(o.num_cached_tokens for o in on)
    total = sum(len(p) for p in prompts)
    assert served >= 0.5 * total, (served, total)
    assert cached.stats().prompt_tokens_cached == served
    # and they are transformers' numbers
    for prompt, out in list(zip(prompts, on, strict=True))[::5]:
        ref = hf_logprobs(path, prompt)
        for pos in range(1, len(prompt)):
            for token, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(ref[pos - 1, token])) < 1e-4


def test_more_alternatives_than_kept_are_computed(checkpoints):
    path = checkpoints["llama"]
    prompts = scoring_prompts(seed=5, questions=3, choices=2)
    llm = engine(path, caching=True)
    score(llm, prompts, k=1)  # the prefix's blocks keep one alternative
    wider = score(llm, prompts[:1], k=4)
    assert wider[0].num_cached_tokens == 0  # its blocks kept too few: computed
    assert all(len(e) >= 4 for e in wider[0].prompt_logprobs[1:])
    assert_same_logprobs(wider, score(engine(path, caching=False), prompts[:1], k=4))
    # now they keep four: a request asking for two or four takes them
    again = score(llm, prompts, k=2)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_same_logprobs(again, score(engine(path, caching=False), prompts, k=2))


def test_evicted_blocks_take_their_logprobs_with_them(checkpoints):
    path = checkpoints["qwen2"]
    first, second = scoring_prompts(seed=7, questions=2), scoring_prompts(seed=8, questions=2)
    # a pool too small to keep both prefixes: the second job evicts the first's blocks
    llm = engine(path, caching=True, num_kv_blocks=40, max_num_seqs=2)
    score(llm, first, k=1)
    score(llm, second, k=1)
    again = score(llm, first, k=1)
    assert_same_logprobs(again, score(engine(path, caching=False), first, k=1))
    assert all(
        block.logprobs is None or block.key in llm.block_manager.cached
        for block in llm.block_manager.blocks
    )
