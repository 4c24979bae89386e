"""The engine's refusals cross into the service by type: each kind of error the engine raises
(or leaves on a failed request's output) becomes its own error code and names the body field it
comes from, whatever its message says; an error of no kind is the engine's own, a 500 that
shows no internals."""

from __future__ import annotations

import pytest

from conveyor.engine.errors import (
    ContextLengthError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    RequestFailure,
    StructuredOutputError,
)
from conveyor.engine.sampling_params import SamplingParams, StructuredOutputsParams
from conveyor.request_outcome import engine_error
from conveyor.wire_format.bodies import CHAT_URL, COMPLETIONS_URL
from conveyor.wire_format.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_PROMPT,
    INVALID_RESPONSE_FORMAT,
    INVALID_SAMPLING_PARAMS,
)
from conveyor.wire_format.request_line import ParsedRequest

COMPLETION = ParsedRequest("c", COMPLETIONS_URL, "m", {}, prompt="hi", line=3)
CHAT = ParsedRequest("c", CHAT_URL, "m", {}, messages=[{"role": "user", "content": "hi"}])

KINDS = [
    (ContextLengthError("too long"), CONTEXT_LENGTH_EXCEEDED, "body.prompt"),
    (InvalidPromptError("empty"), INVALID_PROMPT, "body.prompt"),
    (StructuredOutputError("no"), INVALID_RESPONSE_FORMAT, "body.response_format"),
    (InvalidSamplingParamsError("bad", "top_k"), INVALID_SAMPLING_PARAMS, "body.top_k"),
    (
        InvalidSamplingParamsError("bad", "prompt_logprobs"),
        INVALID_SAMPLING_PARAMS,
        "body.logprobs",
    ),
]


@pytest.mark.parametrize(("err", "code", "param"), KINDS)
@pytest.mark.parametrize("message", ["as written", "reworded: prompt context length"])
def test_each_kind_has_its_code_whatever_the_message(err, code, param, message):
    reworded = (
        type(err)(message, err.field)
        if type(err) is InvalidSamplingParamsError
        else type(err)(message)
    )
    for raised in (reworded, RequestFailure.of(reworded)):  # added, or failed in a step
        error = engine_error(raised, COMPLETION, "r1")
        assert (error.code, error.param, error.status_code) == (code, param, 400)
        assert error.detail == message and error.line == 3


def test_a_prompt_error_of_a_chat_names_its_messages():
    for err in (ContextLengthError("too long"), InvalidPromptError("empty")):
        assert engine_error(err, CHAT, "r1").param == "body.messages"


def test_an_error_of_no_kind_is_the_engines_and_shows_no_internals(caplog):
    failure = RequestFailure.of(IndexError("index 9 is out of bounds for dimension 0"))
    assert failure.internal and failure.kind is None
    error = engine_error(failure, COMPLETION, "r7")
    assert (error.code, error.status_code) == (INTERNAL_ERROR, 500)
    assert "index 9" not in error.detail and "r7" in error.detail
    assert "IndexError: index 9" in caplog.text  # the log carries what the client is not told


def test_the_engine_raises_each_kind():
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(top_k=-5)
    assert info.value.field == "top_k"
    with pytest.raises(StructuredOutputError):
        StructuredOutputsParams(json="{}", regex="a")
    assert issubclass(ContextLengthError, InvalidPromptError)
    for kind in (InvalidPromptError, InvalidSamplingParamsError, StructuredOutputError):
        assert issubclass(kind, InvalidRequestError)  # one `except` catches every refusal
