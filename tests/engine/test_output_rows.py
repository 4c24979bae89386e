"""The last layer runs past attention only for the rows whose hidden states are read (sampled
rows, prompt-logprob rows): the outputs equal those of a pass over every row."""

from __future__ import annotations

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.model_runner import StepLayout
from tests.hf_reference import random_prompts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skipping_unread_rows_changes_no_output(checkpoints, monkeypatch, dtype):
    prompts = random_prompts(6, 5, 70, seed=3)
    # prompt logprobs for some requests only: their rows are kept between skipped ones
    params = [
        SamplingParams(temperature=0, max_tokens=5, logprobs=2,
                       prompt_logprobs=1 if i % 2 else None)
        for i in range(len(prompts))
    ]  # fmt: skip

    def run():
        # chunks of 32 tokens: most prefill rows feed only the cache
        llm = LLM(str(checkpoints["llama"]), device="cpu", dtype=dtype, max_num_batched_tokens=32)
        return llm.generate(prompts, params, use_tqdm=False)

    kept, every = [], StepLayout.output_rows

    def recorded(self):
        kept.append((every(self), len(self.input_ids)))
        return kept[-1][0]

    monkeypatch.setattr(StepLayout, "output_rows", recorded)
    skipping = run()
    assert any(rows is not None and len(rows) < total for rows, total in kept)
    monkeypatch.setattr(StepLayout, "output_rows", lambda self: None)
    full = run()
    for a, b in zip(skipping, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None and y is None) or all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_a_step_of_decodes_is_laid_out_as_the_general_path_lays_it_out():
    """The decode-only layout (whole lists at once) against the token-at-a-time one, forced
    by naming a prompt-logprob sequence that is not in the step: the same ids, positions,
    slots, tables and sampled rows, a one-token chunk of a longer prompt sampling nothing."""
    from conveyor.engine.scheduler import ScheduledSeq
    from conveyor.engine.sequence import Request, Sequence

    block = 4
    seqs = []
    for i, (tokens, computed) in enumerate([(9, 8), (3, 2), (17, 16), (12, 5), (5, 4)]):
        request = Request(f"r{i}", None, list(range(tokens)), SamplingParams())
        seq = Sequence(request, 0, [100 * i + t for t in range(tokens)], tokens)
        seq.tables = [[50 + 10 * i + b for b in range(-(-tokens // block))]]
        seq.num_computed_tokens = computed
        seqs.append(seq)
    scheduled = [ScheduledSeq(seq, 1) for seq in seqs]  # seq 3: one token of a longer prompt
    fast = StepLayout.of(scheduled, set(), block)
    general = StepLayout.of(scheduled, {-1}, block)
    assert fast == general
    assert fast.sample_rows == [0, 1, 2, 4]
    assert fast.slots == [[(50 + 10 * i + p // block) * block + p % block
                           for i, p in enumerate([8, 2, 16, 5, 4])]]  # fmt: skip
    assert StepLayout.of([], set(), block) == StepLayout.of([], {-1}, block)
    mixed = [ScheduledSeq(seqs[3], 3), ScheduledSeq(seqs[0], 1)]  # a chunk of 3, then a decode
    assert len(StepLayout.of(mixed, set(), block).input_ids) == 4
    assert StepLayout.of(mixed, set(), block) == StepLayout.of(mixed, {-1}, block)
