"""Penalties, logit_bias and allowed_token_ids against a reference greedy loop on the
transformers model (OpenAI's and vLLM's formulas written out one token at a time), on every
tiny architecture (GQA, tied embeddings), with rows of different settings in one batch."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.logits_processors import flat_pairs, unique_pairs
from tests.hf_reference import ARCHS, hf_greedy, hf_model, random_prompts

EOS = 2  # <|im_end|> in the tiny checkpoints' tokenizer

SETTINGS = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.2},
    {"frequency_penalty": -0.8, "presence_penalty": 0.6},
    {"repetition_penalty": 1.4},
    {"repetition_penalty": 0.7},
    {"logit_bias": {7: 4.0, 11: -100.0, 40: 2.5}},
    {"logit_bias": {5: 3.0}, "frequency_penalty": 0.9, "repetition_penalty": 1.2},
    {},  # a row with no adjustments in the same batch
]


def reference_greedy(path, prompt: list[int], settings: dict, max_tokens: int) -> list[int]:
    """One token at a time on transformers' logits: bias, then the repetition penalty (prompt
    and generated tokens), then frequency and presence (generated tokens), then argmax."""
    model = hf_model(str(path))
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float().clone()
        for token, bias in settings.get("logit_bias", {}).items():
            logits[token] += bias
        rep = settings.get("repetition_penalty", 1.0)
        for token in set(tokens):
            value = logits[token]
            logits[token] = value / rep if value > 0 else value * rep
        for token in set(out):
            logits[token] -= settings.get("frequency_penalty", 0.0) * out.count(token)
            logits[token] -= settings.get("presence_penalty", 0.0)
        if "allowed_token_ids" in settings:
            keep = torch.full_like(logits, float("-inf"))
            keep[settings["allowed_token_ids"]] = 0.0
            logits += keep
        token = int(torch.argmax(logits))
        tokens.append(token)
        out.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_penalties_and_bias_match_the_reference_loop(checkpoints, arch):
    path = checkpoints[arch]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8)
    prompts = random_prompts(len(SETTINGS), 6, 40, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=14, **s) for s in SETTINGS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    changed = 0
    for prompt, settings, out in zip(prompts, SETTINGS, outputs, strict=True):
        want = reference_greedy(path, prompt, settings, 14)
        assert out.outputs[0].token_ids == want, settings
        changed += want != hf_greedy(path, prompt, 14)
    # the settings do change what greedy decoding picks: on most rows, for every family
    assert changed > len(SETTINGS) // 2


def test_allowed_token_ids_limit_every_token(checkpoints):
    path = checkpoints["llama"]
    llm = LLM(str(path), device="cpu", dtype="float32")
    allowed = [9, 17, 33, 64, 200, EOS]
    settings = {"allowed_token_ids": allowed, "presence_penalty": 0.5}
    prompt = random_prompts(2, 12, 12, seed=2)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, **settings),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    assert out == reference_greedy(path, prompt, settings, 10)
    assert set(out) <= set(allowed)
    sampled = llm.generate(
        [prompt] * 4,
        SamplingParams(temperature=1.5, seed=3, max_tokens=12, allowed_token_ids=allowed),
        use_tqdm=False,
    )
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)


def test_a_bias_of_100_forces_and_minus_100_bans(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]), device="cpu", dtype="float32")
    prompt = random_prompts(2, 20, 20, seed=8)[0]
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=6,
                          logit_bias={123: 100}), use_tqdm=False)[0]  # fmt: skip
    assert forced.outputs[0].token_ids == [123] * 6
    greedy = hf_greedy(checkpoints["qwen2"], prompt, 8)
    banned = {t: -100.0 for t in greedy}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=banned),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    assert not set(out) & set(greedy)


def test_penalties_apply_to_every_sample_of_n_and_to_sampling(checkpoints):
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32")
    prompt = random_prompts(2, 16, 16, seed=4)[0]
    heavy = SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=24, frequency_penalty=2.0,
                           presence_penalty=2.0)  # fmt: skip
    light = SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=24)
    penalised, plain = llm.generate([prompt, prompt], [heavy, light], use_tqdm=False)

    def repeats(out) -> int:
        return sum(len(c.token_ids) - len(set(c.token_ids)) for c in out.outputs)

    assert repeats(penalised) < repeats(plain)
    again = llm.generate([prompt], heavy, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in penalised.outputs]


def test_distinct_pairs_and_their_counts():
    lists = [(0, [1, 1, 3]), (1, []), (2, [0, 4, 4, 4]), (0, [3])]
    row, token, count = unique_pairs(*flat_pairs(lists, torch.device("cpu")), 5)
    assert list(zip(row.tolist(), token.tolist(), count.tolist(), strict=True)) == [
        (0, 1, 2), (0, 3, 2), (2, 0, 1), (2, 4, 3),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be in [-100, 100]"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ],
)
def test_out_of_range_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**settings)


def test_token_ids_outside_the_vocabulary_are_refused(checkpoints):
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32")
    for settings in ({"logit_bias": {10**6: 1.0}}, {"allowed_token_ids": [3, 10**6]}):
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            llm.generate([[5, 6, 7]], SamplingParams(**settings), use_tqdm=False)
