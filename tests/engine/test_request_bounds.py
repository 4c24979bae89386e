"""Every number a request carries is bounded before it reaches a tensor: `SamplingParams` and
the engine's own checks refuse what is out of range with `InvalidRequestError` naming the
field, and whatever they accept runs to an answer. Hypothesis drives both with extreme
integers, floats and lengths; nothing may escape as an exception from torch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.errors import InvalidRequestError
from tests.request_strategies import ANY_FLOAT, ANY_INT

ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=8)

# what a library caller can pass besides: NaN and the infinities
NUMBER = st.one_of(ANY_FLOAT, st.sampled_from([math.nan, math.inf, -math.inf]))
TOKEN_IDS = st.lists(ANY_INT, max_size=6)

FIELDS = {
    "n": ANY_INT,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": ANY_INT,
    "min_p": NUMBER,
    "seed": st.one_of(st.none(), ANY_INT),
    "max_tokens": st.one_of(st.none(), ANY_INT),
    "min_tokens": ANY_INT,
    "stop_token_ids": TOKEN_IDS,
    "logprobs": st.one_of(st.none(), ANY_INT),
    "prompt_logprobs": st.one_of(st.none(), ANY_INT),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "logit_bias": st.one_of(st.none(), st.dictionaries(ANY_INT, NUMBER, max_size=4)),
    "allowed_token_ids": st.one_of(st.none(), TOKEN_IDS),
    "ignore_eos": st.booleans(),
}
IDS = st.lists(st.integers(0, 60), min_size=1, max_size=6)
# settings a client would send, seeds of any size among them: half the cases
PLAUSIBLE = {
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 1e-5, 0.5, 1.0, 2.0]),
    "top_p": st.floats(min_value=1e-6, max_value=1.0),
    "top_k": st.integers(-1, 64),
    "min_p": st.floats(min_value=0.0, max_value=1.0),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "min_tokens": st.integers(0, 2),
    "stop_token_ids": IDS,
    "logprobs": st.one_of(st.none(), st.integers(0, 8)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 8)),
    "presence_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "frequency_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "repetition_penalty": st.floats(min_value=0.1, max_value=3.0),
    "logit_bias": st.dictionaries(st.integers(0, 60), st.floats(-100, 100), max_size=4),
    "allowed_token_ids": st.one_of(st.none(), IDS),
    "ignore_eos": st.booleans(),
}
SETTINGS = st.one_of(
    st.fixed_dictionaries({}, optional=FIELDS), st.fixed_dictionaries({}, optional=PLAUSIBLE)
)


@given(SETTINGS)
@settings(max_examples=1500, deadline=None)
def test_sampling_params_refuse_out_of_range_fields_by_name(kwargs: dict) -> None:
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError as err:
        assert err.field in kwargs or err.field in ("min_tokens", "max_tokens"), (err, kwargs)
        assert err.field in str(err)
        return
    # what is accepted is within what a tensor and the engine take
    for name in ("n", "top_k", "min_tokens"):
        assert 0 <= getattr(params, name) < 2**31
    if params.seed is not None:
        assert 0 <= params.sample_seed(params.n - 1) < 2**64


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["llama"]), **ENGINE_KWARGS)


@given(SETTINGS, st.one_of(IDS, st.lists(ANY_INT, max_size=4)))
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_the_engine_answers_or_refuses_any_request(llm: LLM, kwargs: dict, prompt: list) -> None:
    kwargs["max_tokens"] = min(kwargs.get("max_tokens") or 1, 4) if "max_tokens" in kwargs else 3
    try:
        params = SamplingParams(**kwargs)
        llm.add_request("r", prompt or [1, 2, 3], params)
    except InvalidRequestError as err:
        event(f"refused: {err.field}")
        assert not llm.has_unfinished()  # a refused request leaves nothing behind
        return
    event("answered")
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert [o.request_id for o in outputs if o.finished] == ["r"]
    assert outputs[-1].error is None, outputs[-1].error
    assert len(outputs[-1].outputs) == params.n
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 10**19, "temperature": 1}, "top_k"),  # past int64: torch cannot take it
        ({"seed": 2**64 - 1}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e-300}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"n": 2.5}, "n"),
        ({"stop": ["x"] * 300}, "stop"),
    ],
)
def test_each_bound_names_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 10**6, "temperature": 1}, "top_k"),
        ({"min_tokens": 1, "stop_token_ids": [100000]}, "stop_token_ids"),
        ({"logit_bias": {100000: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
        ({"logprobs": 10**6}, "logprobs"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"n": 9, "temperature": 1}, "n"),  # more samples than max_num_seqs
    ],
)
def test_the_engine_checks_what_only_the_model_bounds(llm: LLM, kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.add_request("bounded", [1, 2, 3], SamplingParams(**kwargs))
    assert info.value.field == field
    assert (
        str(llm.vocab_size - 1) in str(info.value)
        or field == "n"
        or "vocabulary" in str(info.value)
    )
    assert not llm.has_unfinished()


def test_prompt_ids_outside_the_vocabulary_are_the_prompts_fault(llm: LLM) -> None:
    for prompt in ([1, 10**12], [-1], [1, 2**70]):
        with pytest.raises(InvalidRequestError) as info:
            llm.add_request("p", prompt, SamplingParams())
        assert info.value.field == "prompt"


def test_seeds_at_the_edges_of_64_bits_sample_reproducibly(llm: LLM) -> None:
    """Sample i draws from seed + i, reduced mod 2**64 (as torch reads a negative seed): the
    largest seed's second sample is the one seeded with 0."""
    top = SamplingParams(n=2, seed=2**63 - 1, temperature=1.0, max_tokens=6)
    (out,) = llm.generate([[5, 6, 7]], top, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]
    (again,) = llm.generate([[5, 6, 7]], top, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert top.sample_seed(1) == 2**63 and SamplingParams(seed=-1).sample_seed(1) == 0
    generator = torch.Generator().manual_seed(-1)
    assert torch.equal(
        torch.rand(3, generator=generator),
        torch.rand(
            3, generator=torch.Generator().manual_seed(SamplingParams(seed=-1).sample_seed(0))
        ),
    )
