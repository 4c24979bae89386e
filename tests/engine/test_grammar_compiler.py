"""Structured-output grammars compile off the engine thread: while one compiles, the other
requests run their usual steps; one that does not compile in time fails alone, naming the
limit; each grammar compiles once."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest

from conveyor.engine import LLM, SamplingParams, grammar_compiler
from conveyor.engine.config import EngineConfig
from conveyor.engine.sampling_params import StructuredOutputsParams
from tests.hf_reference import random_prompts

PROMPTS = random_prompts(6, 8, 8, seed=33)
PLAIN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", seed=7)


@pytest.fixture
def stalled(monkeypatch):
    """Regexes that start with `stall` compile only once the event is set."""
    release = threading.Event()
    compile_grammar = grammar_compiler._grammar

    def slow(kind: str, text: str) -> str:
        if text.startswith("stall"):
            release.wait()
        return compile_grammar(kind, text)

    monkeypatch.setattr(grammar_compiler, "_grammar", slow)
    yield release
    release.set()  # its compile thread goes back to the pool


def _constrained(regex: str) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)
    )


def _run(llm: LLM, limit_s: float = 30.0) -> dict:
    outputs, start = {}, time.monotonic()
    while llm.has_unfinished():
        assert time.monotonic() - start < limit_s, "the engine did not finish"
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    return outputs


def test_other_requests_run_their_usual_steps_while_a_grammar_compiles(llm, stalled):
    llm.add_request("slow", PROMPTS[0], _constrained("stall-[a-c]{3}"))
    llm.add_request("plain", PROMPTS[1], PLAIN)
    steps = 0
    while True:
        steps += 1
        done = [o for o in llm.step() if o.finished]
        if done:
            break
    assert [o.request_id for o in done] == ["plain"]
    assert steps == PLAIN.max_tokens  # a prefill, then a token a step: nothing waited
    assert len(done[0].outputs[0].token_ids) == PLAIN.max_tokens
    assert llm.structured_outputs.num_compiling == 1 and llm.has_unfinished()

    stalled.set()
    slow = _run(llm)["slow"].outputs[0]
    assert slow.finish_reason == "stop" and re.fullmatch(r"stall-[a-c]{3}", slow.text)


def test_a_grammar_past_the_time_limit_fails_its_request_alone(checkpoints, stalled):
    # the limit must hold a short regex's compile on a busy machine (with llguidance's
    # tokenizer built by the first compile): 0.3 s did not, once, under a full test run
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", grammar_timeout=1.5)
    llm.add_request("stuck", PROMPTS[0], _constrained("stall[0-9]{2}"))
    llm.add_request("plain", PROMPTS[1], PLAIN)
    llm.add_request("quick", PROMPTS[2], _constrained("[xy]{3}"))
    outputs = _run(llm)

    stuck = outputs["stuck"]
    assert str(stuck.error) == "cannot compile the regex constraint within 1.5 s (grammar_timeout)"
    assert (stuck.error.field, stuck.error.internal) == ("structured_outputs", False)
    assert stuck.outputs[0].finish_reason == "error"
    assert len(outputs["plain"].outputs[0].token_ids) == PLAIN.max_tokens
    quick = outputs["quick"].outputs[0]
    assert quick.finish_reason == "stop" and re.fullmatch(r"[xy]{3}", quick.text)

    # the same grammar, still compiling past the limit, is not compiled again: it fails at once
    llm.add_request("again", PROMPTS[3], _constrained("stall[0-9]{2}"))
    (again,) = llm.step()
    assert again.request_id == "again" and str(again.error) == str(stuck.error)
    assert not llm.has_unfinished()


def test_each_grammar_compiles_once(llm, monkeypatch):
    compiled = Counter()
    compile_grammar = grammar_compiler._grammar

    def counted(kind: str, text: str) -> str:
        compiled[kind, text] += 1
        return compile_grammar(kind, text)

    monkeypatch.setattr(grammar_compiler, "_grammar", counted)
    schema = {"type": "object", "properties": {"once": {"enum": ["a", "b"]}},
              "required": ["once"], "additionalProperties": False}  # fmt: skip
    same = dict(reversed(schema.items()))  # the same schema, keys in another order
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(json=s))
        for i, s in enumerate([schema, same, schema])
    ]  # fmt: skip
    first = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    again = llm.generate(PROMPTS[3:6], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in first + again)
    assert list(compiled.values()) == [1]


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(llm, stalled):
    llm.add_request("gone", PROMPTS[0], _constrained("stall-abort"))
    llm.abort("gone")
    assert not llm.has_unfinished() and llm.structured_outputs.num_compiling == 0
    stalled.set()
    assert llm.step() == []
    assert _run(llm) == {}


def test_grammar_timeout_must_be_positive():
    with pytest.raises(ValueError, match="grammar_timeout must be > 0 seconds, got 0"):
        EngineConfig(grammar_timeout=0)
