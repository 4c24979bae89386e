"""Sampling settings, stop conditions, n > 1 and request validation."""

from __future__ import annotations

import itertools

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampler import first_max_index
from conveyor.kernels import native_layers
from tests.hf_reference import hf_greedy, random_prompts

PROMPTS = random_prompts(40, 4, 120, seed=5)
# how a sampled row is drawn: torch's ops, and the native kernel where this CPU runs it
DRAWS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_layers.available(torch.float32), reason="this CPU has no AVX2 and FMA"
        ),
    ),
]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", seed=123)


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=16)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=1 + i % 20) for i in range(39)]
    batch = llm.generate(PROMPTS[1:] + [PROMPTS[0]], others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=43, max_tokens=16)
    assert llm.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12)
    outs = llm.generate([PROMPTS[1]] * 4, params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_top_k_one_and_tiny_top_p_are_greedy(llm, checkpoints):
    want = hf_greedy(checkpoints["llama"], PROMPTS[2], 8)
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8),
        SamplingParams(temperature=1.0, min_p=0.999, max_tokens=8),
    ):
        assert llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_n_samples_share_prompt_blocks_and_copy_on_write(llm, checkpoints):
    # unseen before (no cache hits); ends inside a block, so the shared partial block is copied
    prompt = random_prompts(2, 37, 37, seed=99)[0]
    before = llm.stats().prompt_tokens_computed
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=10), use_tqdm=False)
    assert llm.stats().prompt_tokens_computed - before == len(prompt)  # prefilled once
    want = hf_greedy(checkpoints["llama"], prompt, 10)
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(c.token_ids == want for c in out[0].outputs)

    seeded = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=10)
    samples = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in samples}) > 1
    again = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in samples] == [c.token_ids for c in again]
    assert llm.stats().kv_blocks_used == 0


def test_stop_token_ids_and_min_tokens(llm, checkpoints):
    want = hf_greedy(checkpoints["llama"], PROMPTS[4], 12)
    stop_at = want[5]
    first = want.index(stop_at)
    out = llm.generate(
        [PROMPTS[4]],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == want[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at

    banned = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_at])
    out = llm.generate([PROMPTS[4]], banned, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and stop_at not in out.token_ids
    assert out.finish_reason == "length"


def test_eos_and_ignore_eos(llm):
    eos = next(iter(llm.eos_token_ids))
    # min_tokens bans EOS, max_tokens bounds the run; ignore_eos keeps going past a natural EOS
    out = llm.generate(
        [PROMPTS[5]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    eos_positions = [i for i, t in enumerate(out.token_ids) if t == eos]
    stopped = llm.generate(
        [PROMPTS[5]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False
    )[0].outputs[0]
    if eos_positions:
        assert stopped.token_ids == out.token_ids[: eos_positions[0] + 1]
        assert stopped.finish_reason == "stop"
    else:
        assert stopped.token_ids == out.token_ids


def test_stop_strings_truncate_text(llm):
    full = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    out = llm.generate(
        ["The quick brown fox"],
        SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_max_model_len_and_bad_prompts_are_rejected(checkpoints):
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="prompt has 64 tokens, but max_model_len is 64"):
        llm.add_request("long", list(range(3, 67)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request("oov", [1, 99999], SamplingParams())
    assert not llm.has_unfinished()
    # output is cut at max_model_len
    out = llm.generate(
        [list(range(3, 63))], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_pool_smaller_than_max_model_len_is_refused(checkpoints):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(
            str(checkpoints["llama"]),
            dtype="float32",
            device="cpu",
            num_kv_blocks=4,
            max_model_len=128,
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_abort_frees_blocks(llm):
    llm.add_request("gone", PROMPTS[6], SamplingParams(max_tokens=50))
    llm.add_request("kept", PROMPTS[7], SamplingParams(temperature=0, max_tokens=3))
    llm.step()
    assert llm.stats().kv_blocks_used > 0
    llm.abort("gone")
    finished = []
    while llm.has_unfinished():
        finished += llm.step()
    assert [o.request_id for o in finished] == ["kept"]
    assert llm.stats().kv_blocks_used == 0


def test_chat_uses_the_template(llm):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    ids = llm.apply_chat_template(conversation)
    text = llm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].prompt_token_ids == ids and len(out[0].outputs[0].token_ids) >= 1


def test_first_max_index_is_argmax_with_first_index_on_ties():
    logits = torch.randn(64, 32000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first_max_index(logits), logits.argmax(dim=-1))
    tied = torch.zeros(3, 10)
    tied[0, [2, 7]] = 5.0
    tied[1, :] = float("-inf")
    tied[1, [4, 9]] = 1.0
    assert first_max_index(tied).tolist() == [2, 4, 0]


def test_plain_greedy_rows_are_picked_from_logits_in_their_own_dtype(monkeypatch):
    """bfloat16 logits of greedy rows with nothing to adjust are read as they are; a row that
    asks for logprobs, or has a logit bias, sends the batch through the float32 path. Both
    pick the same tokens."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sampler = Sampler(torch.Generator().manual_seed(0))
    widened = []
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.dtype) or to_float(t))

    def rows(**extra):
        params = [SamplingParams(temperature=0, **(extra if i == 5 else {})) for i in range(6)]
        return [SampleRequest(p, None, []) for p in params]

    want = logits.float().argmax(dim=-1).tolist()
    widened.clear()
    plain = sampler(logits, rows())
    assert plain.token_ids == want and plain.logprobs == [None] * 6 and widened == []
    with_logprobs = sampler(logits, rows(logprobs=2))
    assert with_logprobs.token_ids == want and with_logprobs.logprobs[5] is not None
    biased = sampler(logits, rows(logit_bias={7: 100.0}))
    assert biased.token_ids == want[:5] + [7]
    assert widened == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("draw", DRAWS)
def test_only_the_sampled_rows_of_a_mixed_step_are_sampled(draw):
    """One sampled row among greedy ones draws noise for its own row alone (the generator moves
    as far as for that row sampled by itself) and the greedy rows keep their argmax, with or
    without logprobs asked for."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    logits = torch.randn(64, 700, generator=torch.Generator().manual_seed(2))
    for extra in ({}, {"logprobs": 1}):
        mixed = Sampler(torch.Generator().manual_seed(9), draw)
        alone = Sampler(torch.Generator().manual_seed(9), draw)
        rows = [SampleRequest(SamplingParams(temperature=0, **extra), None, []) for _ in range(64)]
        rows[40] = SampleRequest(SamplingParams(temperature=1.0, **extra), None, [])
        result = mixed(logits, rows)
        single = alone(logits[40:41], rows[40:41])
        assert result.token_ids[40] == single.token_ids[0]
        assert torch.equal(mixed.generator.get_state(), alone.generator.get_state())
        want = logits.argmax(dim=-1).tolist()
        assert result.token_ids[:40] + result.token_ids[41:] == want[:40] + want[41:]
        assert (result.logprobs[0] is not None) == bool(extra)


def test_stop_strings_give_the_text_of_the_whole_decode(llm):
    """Stop strings found in the text as it comes: where the whole output's decode has them,
    spanning tokens or not, kept with include_stop_str_in_output; a stream's texts grow to it."""
    prompts = PROMPTS[6:10]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fulls = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    tok = llm.tokenizer
    for prompt, full in zip(prompts, fulls, strict=True):
        assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
        for start, size in ((0, 1), (len(full.text) // 3, 3), (len(full.text) - 2, 2)):
            stop = full.text[start : start + size]
            if "\ufffd" in stop:  # an unfinished character's, in the decode of a prefix
                continue
            for include in (False, True):
                params = SamplingParams(
                    temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never"],
                    include_stop_str_in_output=include,
                )  # fmt: skip
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                end = full.text.index(stop) + (len(stop) if include else 0)
                assert (out.text, out.stop_reason) == (full.text[:end], stop)
                ids = out.token_ids
                assert ids == full.token_ids[: len(ids)]
                assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])

    llm.add_request("s", PROMPTS[6], greedy, stream=True)
    texts = []
    while llm.has_unfinished():
        texts += [o.outputs[0].text for o in llm.step() if o.request_id == "s"]
    assert texts[-1] == fulls[0].text
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def sampled_frequencies(
    logits: torch.Tensor, params: SamplingParams, draws: int, draw: str
) -> torch.Tensor:
    """How often each token of one row of `logits` is drawn in `draws` rows sampled at once."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    sampler = Sampler(torch.Generator().manual_seed(3), draw)
    rows = [SampleRequest(params, None, []) for _ in range(draws)]
    tokens = torch.tensor(sampler(logits.expand(draws, -1).clone(), rows).token_ids)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(temperature=0.7), None),
        (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0, 1]),  # 0.49 + 0.23 reach 0.7
        (SamplingParams(temperature=1.0, min_p=0.2), [0, 1, 2]),
        (SamplingParams(temperature=1.0, top_k=4, top_p=0.999), [0, 1, 2, 3]),
    ],
)
@pytest.mark.parametrize("draw", DRAWS)
def test_sampled_tokens_follow_the_distribution(params, kept, draw):
    """Each token is drawn as often as its probability says (within 5 standard deviations of
    40,000 draws): the softmax at the row's temperature, renormalised over what top-k, top-p
    and min-p keep; a token they drop is never drawn."""
    probs = torch.tensor([0.49, 0.23, 0.13, 0.08, 0.04, 0.02, 0.01, 0.0], dtype=torch.float64)
    logits = probs.clamp(min=1e-30).log().float()[None, :]
    want = torch.softmax(logits.double() / params.temperature, dim=-1)[0]
    if kept is not None:
        mask = torch.zeros_like(want, dtype=torch.bool)
        mask[kept] = True
        want = torch.where(mask, want, 0.0)
        want /= want.sum()
    draws = 40_000
    got = sampled_frequencies(logits, params, draws, draw)
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((got - want).abs() <= 5 * sigma + 1e-12).all(), (got, want)
    assert (got[want == 0] == 0).all()


@pytest.mark.skipif(not native_layers.available(torch.float32), reason="no AVX2 and FMA")
def test_the_native_draw_takes_the_tokens_the_torch_draw_takes():
    """With the same uniform numbers, the native draw picks what torch's picks, through every
    path of top-k and top-p: rows settled among their k or 64 most likely tokens (drawn among
    those alone), flat rows whose nucleus needs a sort of the whole vocabulary, and rows with
    neither, at several temperatures and min_p's, mixed in one call."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    g = torch.Generator().manual_seed(12)
    settings = [dict(top_k=50), dict(top_p=0.9), dict(top_k=7, top_p=0.8), dict(), dict(top_k=1),
                dict(top_k=2000), dict(top_p=0.5, min_p=0.05), dict(min_p=0.2)]  # fmt: skip
    params = [SamplingParams(temperature=t, **kw) for kw in settings for t in (0.5, 1.0, 1.7)]
    rows = [SampleRequest(p, None, []) for p in params]
    for scale in (0.3, 2.0, 12.0):  # flat rows (top-p sorts them whole) to peaked ones
        logits = torch.randn(len(rows), 5000, generator=g) * scale
        native = Sampler(torch.Generator().manual_seed(5), "native")(logits, rows)
        reference = Sampler(torch.Generator().manual_seed(5), "torch")(logits, rows)
        assert native.token_ids == reference.token_ids, scale


@pytest.mark.skipif(not native_layers.available(torch.float32), reason="no AVX2 and FMA")
@pytest.mark.parametrize("top_k", [0, 4, 2000])
def test_the_native_draw_keeps_every_token_tied_at_the_edge_of_the_nucleus(top_k):
    """Probabilities 0.4, 0.2, 0.2, 0.2 (then 0.1 and a tail) with top_p 0.5: the nucleus ends
    among three tied tokens, and the native draw keeps all three, with or without a top-k
    (among its candidates, or a whole row masked past its k): each of the four is drawn as
    often as its share of them says, what lies past them never."""
    vocab = 3000
    logits = torch.full((1, vocab), -30.0)
    logits[0, [7, 2900, 15, 1500, 3]] = torch.tensor([0.4, 0.2, 0.2, 0.2, 0.1]).log()
    params = SamplingParams(temperature=1.0, top_p=0.5, top_k=top_k)
    draws = 10_000  # 5 sigma is 0.02 at 0.2: one tied token dropped moves the rest by 0.07
    got = sampled_frequencies(logits, params, draws, "native")
    want = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((got[[7, 2900, 15, 1500]] - want).abs() <= 5 * sigma).all(), got[[7, 2900, 15, 1500]]
    got[[7, 2900, 15, 1500]] = 0.0
    assert (got == 0).all()  # nothing past the nucleus


@pytest.mark.skipif(not native_layers.available(torch.float32), reason="no AVX2 and FMA")
def test_a_row_drawn_among_its_candidates_is_drawn_alike_in_any_batch(monkeypatch):
    """A seeded row's draw among its top-k candidates does not depend on the other rows of the
    step: it draws from a row of its own k candidates (not the widest k of the step, where its
    kept tokens would sit elsewhere and its float64 sums add in another order), and so takes
    the same token alone as beside rows of other k's."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    widths = []
    draw = native_layers.draw

    def recording(logits, *args):
        widths.append(logits.shape[1])
        return draw(logits, *args)

    monkeypatch.setattr(native_layers, "draw", recording)
    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(8)) * 3
    for seed in range(20):
        row = SampleRequest(SamplingParams(temperature=1.0, top_k=5), torch.Generator(), [])
        row.generator.manual_seed(seed)
        widths.clear()
        alone = Sampler(torch.Generator().manual_seed(0), "native")(logits[:1], [row])
        assert widths == [5]
        row.generator.manual_seed(seed)
        others = [
            SampleRequest(SamplingParams(temperature=0.9, top_k=k), None, []) for k in (50, 300)
        ]
        widths.clear()
        batch = Sampler(torch.Generator().manual_seed(0), "native")(logits, [row, *others])
        assert sorted(widths) == [5, 50, 300]
        assert batch.token_ids[0] == alone.token_ids[0]


def test_top_k_and_top_p_keep_what_a_sort_of_the_whole_vocabulary_keeps():
    """The CPU's shortcuts (a row with a k looks at its k most likely tokens, a row without
    at its 64 most likely first) keep the tokens the full sort keeps, on flat and peaked rows;
    a top_p of 1 drops nothing, however a float32 sum rounds."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import _sorted_top_k_top_p, _top_k_top_p

    g = torch.Generator().manual_seed(4)
    vocab = 3000
    settings = [(0, 0.9), (20, 1.0), (50, 0.7), (0, 1.0), (0, 0.99), (2000, 0.8), (5, 0.5)]
    for scale in (0.5, 3.0, 10.0, 40.0):
        logits = torch.randn(len(settings), vocab, generator=g) * scale
        params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in settings]
        rows = [SampleRequest(p, None, []) for p in params]
        top_k = torch.tensor([float(k or vocab) for k, _ in settings])
        top_p = torch.tensor([p for _, p in settings])
        got = _top_k_top_p(logits, top_k, top_p, rows)
        want = _sorted_top_k_top_p(logits, top_k, top_p)
        assert torch.equal(got.isinf(), want.isinf()), scale
        assert torch.equal(got[~got.isinf()], logits[~got.isinf()])
        kept = (~got.isinf()).sum(dim=-1).tolist()
        assert kept[1] == 20 and kept[3] == vocab  # top_p 1: the k, or all of the row


@pytest.mark.parametrize("draw", DRAWS)
def test_a_draw_is_one_number_a_row_whatever_the_vocabulary(draw):
    """A sampled row moves the generator by one number, not one a token (the draw inverts the
    row's cumulative sum), so a seeded row's next draw does not depend on the vocabulary."""
    from conveyor.engine.logits_processors import SampleRequest
    from conveyor.engine.sampler import Sampler

    for vocab in (10, 50_000):
        seeded = torch.Generator().manual_seed(11)
        sampler = Sampler(torch.Generator().manual_seed(0), draw)
        rows = [SampleRequest(SamplingParams(temperature=1.0), seeded, [])]
        sampler(torch.zeros(1, vocab), rows)
        reference = torch.Generator().manual_seed(11)
        torch.rand(1, generator=reference)
        assert torch.equal(seeded.get_state(), reference.get_state())
