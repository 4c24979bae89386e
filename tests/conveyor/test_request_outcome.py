"""What becomes of one batch line is decided in one place (`request_outcome`), for the worker
and `conveyor run` alike: its own error line when it does not parse, "internal error" with the
request's id (and nothing of the fault) when preparing or formatting it breaks, the error of
its kind when the engine refuses it, else its result line."""

from __future__ import annotations

import json
import logging

import pytest

from conveyor.engine.errors import InvalidSamplingParamsError, RequestFailure
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.request_outcome import PreparedLine, output_line, prepare_line, refused_line
from conveyor.wire_format.request_line import parse_request_line
from conveyor.wire_format.token_text import TokenDecoder

LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": "m", "prompt": "hi", "max_tokens": 2},
}


class Engine:  # what preparing a completion asks of an engine: nothing but being there
    tokenizer = None
    default_sampling: dict = {}
    reasoning_parser = None
    tool_call_parser = None

    def prepare_prompt(self, prompt):
        return prompt


def parse(raw, line):
    return parse_request_line(raw, line=line)


def output(error: RequestFailure | None = None) -> RequestOutput:
    done = CompletionOutput(0, "ok", [5, 6], None, None, "length")
    return RequestOutput("r1", "hi", [1, 2], None, [done], finished=True, error=error)


def test_a_good_line_is_prepared_and_answered():
    prepared = prepare_line(Engine(), json.dumps(LINE), 1, "b:1", parse)
    assert isinstance(prepared, PreparedLine) and prepared.prompt == "hi"
    assert prepared.params.max_tokens == 2
    line, ok = output_line(prepared.parsed, output(), "m", TokenDecoder(None), "b:1")
    assert ok and line["custom_id"] == "a" and line["response"]["status_code"] == 200


def test_a_bad_line_gets_its_own_error_line():
    bad = {**LINE, "body": {**LINE["body"], "temperature": "hot"}}
    line = prepare_line(Engine(), json.dumps(bad), 4, "b:4", parse)
    assert not isinstance(line, PreparedLine)
    assert line["custom_id"] == "a" and line["error"]["line"] == 4
    assert "temperature" in line["error"]["param"]


def test_a_fault_while_preparing_is_an_internal_error_naming_the_request(caplog):
    def broken(raw, line):
        raise KeyError("secret internals")

    with caplog.at_level(logging.ERROR):
        line = prepare_line(Engine(), json.dumps(LINE), 7, "b:7", broken)
    assert line["error"]["code"] == "internal_error" and line["custom_id"] == "a"
    assert "b:7" in line["error"]["message"] and "secret" not in line["error"]["message"]
    assert "secret internals" in caplog.text


@pytest.mark.parametrize("via", ["refused", "output"])
def test_the_engines_refusal_is_the_error_of_its_kind(via):
    parsed = parse(json.dumps(LINE), 2)
    err = InvalidSamplingParamsError("top_k must be at least -1", "top_k")
    if via == "refused":
        line, ok = refused_line(err, parsed, "b:2"), False
    else:
        line, ok = output_line(
            parsed, output(RequestFailure.of(err)), "m", TokenDecoder(None), "b:2"
        )
    assert not ok
    assert (line["error"]["code"], line["error"]["param"]) == (
        "invalid_sampling_params",
        "body.top_k",
    )


def test_a_fault_while_formatting_is_an_internal_error(caplog):
    parsed = parse(json.dumps(LINE), 3)
    broken = output()
    broken.outputs = None  # formatting it raises
    line, ok = output_line(parsed, broken, "m", TokenDecoder(None), "b:3")
    assert not ok and line["error"]["code"] == "internal_error"
    assert "b:3" in line["error"]["message"] and "formatting" in caplog.text


def key_of(body: dict, custom_id: str = "a") -> str | None:
    from conveyor.request_outcome import reuse_key

    line = {**LINE, "custom_id": custom_id, "body": body}
    prepared = prepare_line(Engine(), json.dumps(line), 1, "b:1", parse)
    assert isinstance(prepared, PreparedLine)
    return reuse_key(prepared)


def test_a_reuse_key_is_exact_and_blind_to_spelling():
    greedy = {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    key = key_of(greedy)
    assert key is not None and len(key) == 32
    # key order, another custom_id and a default given outright change nothing
    assert key_of(dict(reversed(greedy.items())), "other") == key
    assert key_of({**greedy, "top_p": 1.0, "presence_penalty": 0}) == key
    # anything that can change the answer does
    for change in ({"prompt": "hi "}, {"max_tokens": 3}, {"model": "n"}, {"logprobs": 1},
                   {"echo": True}, {"stop": ["x"]}, {"seed": 3}):  # fmt: skip
        assert key_of({**greedy, **change}) not in (key, None), change
    # a sampled line has a key only with a seed
    assert key_of({**greedy, "temperature": 0.7}) is None
    seeded = key_of({**greedy, "temperature": 0.7, "seed": 1})
    assert seeded is not None and seeded != key_of({**greedy, "temperature": 0.7, "seed": 2})


def test_a_reuse_key_is_the_one_keys_were_made_with():
    """Keys stored by earlier versions hold the sampling settings as `dataclasses.asdict`
    wrote them: the faster form must give the same text, nested settings and all."""
    import dataclasses

    from conveyor.request_outcome import _sampling_fields

    bodies = [
        {"temperature": 0},
        {"temperature": 0.5, "seed": 7, "stop": ["a", "b"], "logit_bias": {"5": 2.0, "3": -1}},
        {"temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
        {"temperature": 0, "logprobs": 2, "max_tokens": 5, "presence_penalty": 0.5},
    ]  # fmt: skip
    made = []
    for body in bodies:
        line = {**LINE, "body": {"model": "m", "prompt": "hi", **body}}
        prepared = prepare_line(Engine(), json.dumps(line), 1, "b:1", parse)
        assert isinstance(prepared, PreparedLine), prepared
        params = prepared.params
        fast, slow = _sampling_fields(params), dataclasses.asdict(params)
        assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True)
        made.append(params)
    assert made[3].logprobs == 2
    assert dataclasses.is_dataclass(made[2].structured_outputs)
