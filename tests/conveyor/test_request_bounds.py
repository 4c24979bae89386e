"""A request body with any numbers in it is refused with an error naming a field of the body,
or runs to an answer: Hypothesis drives completion and chat bodies through the checks the
API and the worker make (`parse_online_body`, `prepare_request`, the engine's `add_request`)
and then the engine, with extreme integers, floats and lengths. Nothing may escape as an
exception from torch or the engine, and no field is blamed that the body does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings

from conveyor.engine import LLM
from conveyor.engine.errors import InvalidRequestError
from conveyor.request_outcome import engine_error, prepare_request
from conveyor.wire_format.bodies import CHAT_URL, COMPLETIONS_URL
from conveyor.wire_format.errors import RequestError
from conveyor.wire_format.request_line import parse_online_body
from tests.request_strategies import CHATS, COMPLETIONS


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(
        str(checkpoints["llama"]), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
        max_num_seqs=8, max_model_len=48,
    )  # fmt: skip


def answer_or_refuse(llm: LLM, url: str, fields: dict) -> None:
    body = {"model": "m", **fields}
    if url == CHAT_URL:
        body["messages"] = [{"role": "user", "content": "hi"}]
    if "max_tokens" not in fields and "max_completion_tokens" not in fields:
        body["max_tokens"] = 3
    try:
        online = parse_online_body(url, body)
        runs = [prepare_request(llm, request) for request in online.requests]
    except RequestError as err:
        event(f"refused at the door: {err.param}")
        assert err.status_code == 400 and err.param, err
        assert err.param.removeprefix("body.").split(".")[0].split("[")[0] in body, err
        return
    for i, ((prompt, params), request) in enumerate(zip(runs, online.requests, strict=True)):
        params.max_tokens = min(params.max_tokens or 3, 3)  # bounded work per example
        try:
            llm.add_request(f"r{i}", prompt, params)
        except InvalidRequestError as err:
            error = engine_error(err, request, f"r{i}")
            event(f"refused by the engine: {error.param}")
            assert error.status_code == 400 and error.param, error
            assert error.param.removeprefix("body.") in body, error
            continue
        event("answered")
    while llm.has_unfinished():
        for output in llm.step():
            assert output.error is None, output.error
    assert llm.stats().kv_blocks_used == 0


@given(COMPLETIONS)
@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_completion_bodies_are_answered_or_refused_by_field(llm: LLM, fields: dict) -> None:
    answer_or_refuse(llm, COMPLETIONS_URL, fields)


@given(CHATS)
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_chat_bodies_are_answered_or_refused_by_field(llm: LLM, fields: dict) -> None:
    answer_or_refuse(llm, CHAT_URL, fields)
