"""Generated and prompt logprobs equal log-softmax of transformers' logits."""

from __future__ import annotations

import math

import pytest

from conveyor.engine import LLM, SamplingParams
from tests.hf_reference import ARCHS, hf_logprobs, random_prompts


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(checkpoints, arch):
    path = checkpoints[arch]
    prompts = random_prompts(4, 5, 90, seed=11)
    llm = LLM(
        str(path), dtype="float32", device="cpu", max_num_batched_tokens=32
    )  # prompt logprobs over chunks
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        completion = out.outputs[0]
        ref = hf_logprobs(path, prompt + completion.token_ids)

        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert prompt[pos] in entry and len(entry) in (2, 3)  # actual token + top-2
            for token, lp in entry.items():
                assert abs(lp - float(ref[pos - 1, token])) < 1e-4

        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = ref[len(prompt) + i - 1]
            top3 = row.topk(3).indices.tolist()
            assert set(top3) <= set(entry) and token in entry
            for t, lp in entry.items():
                assert abs(lp - float(row[t])) < 1e-4
            total += float(row[token])
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)


def test_prompt_logprobs_compute_blocks_that_kept_none(checkpoints):
    """Blocks cached by a request that asked for no prompt logprobs kept none, so a request
    asking for them computes its whole prompt."""
    path = checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompt = list(range(10, 80))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert all(e is not None for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_are_computed_in_chunks_the_memory_budget_holds(checkpoints):
    """A budget of a few rows of logits splits a long prompt's positions into chunks of that
    many rows (never more logits held at once), with the same logprobs as unsplit."""
    path = checkpoints["llama"]
    prompt = random_prompts(2, 200, 200, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    whole = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
    want = whole.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs

    vocab = whole.vocab_size
    budget = 5 * vocab * (4 + 4 + 4)  # five float32 rows: logits, widened, log-softmax
    split = LLM(
        str(path), dtype="float32", device="cpu", enable_prefix_caching=False,
        prompt_logprobs_memory=budget,
    )  # fmt: skip
    scorer = split.prompt_logprobs
    assert scorer.chunk_rows == 5
    rows_held = []
    compute = scorer.model.compute_logits
    scorer.model.compute_logits = lambda h: rows_held.append(h.shape[0]) or compute(h)
    got = split.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert rows_held and max(rows_held) == 5 and sum(rows_held) >= len(prompt) - 1
    assert got == want
