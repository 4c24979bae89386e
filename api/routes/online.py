"""OpenAI's online endpoints, `POST /v1/completions`, `POST /v1/chat/completions` and `POST
/v1/responses` (and streamed, `stream: true`), and vLLM's `/tokenize`, `/detokenize` and
`/tokenizer_info`: answered by the workers that run batches, in the same continuous batches and
ahead of them.

Bodies are checked as batch lines' bodies are (`conveyor.wire_format`), and answered with the
same response objects. An unknown model is a 404 `model_not_found` at once, a model no live
worker serves a 503, and an answer that does not come within `CONVEYOR_ONLINE_TIMEOUT` a 504.
Completions are held to the limits of `api.online_limits` (400, or 429 for a project with too
many sequences in flight or that starts requests too fast), and a client that goes away
cancels its work in the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import Response

from conveyor.api import schemas
from conveyor.api.deps import AppState, ProjectDep, StateDep
from conveyor.api.errors import APIError
from conveyor.api.guard import KeyedRoute
from conveyor.api.online_lease import LeasedStream, OnlineLease, unless_gone
from conveyor.api.online_limits import check_prompt_count, check_rate, check_sequences, sequences_of
from conveyor.dispatch.online import AnswerTimeout, OnlineMessage, online_queue
from conveyor.dispatch.queues import queue_for
from conveyor.served_names import listed_names
from conveyor.wire_format.bodies import (
    CHAT_URL,
    COMPLETIONS_URL,
    RESPONSES_URL,
    DetokenizeBody,
    TokenizeBody,
)
from conveyor.wire_format.errors import (
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    MODEL_UNAVAILABLE,
    TIMEOUT,
    RequestError,
)
from conveyor.wire_format.request_line import parse_online_body, validation_message

ONLINE_ERRORS = schemas.error_responses(404, 413, 422, 503, 504)
URLS = {"completion": COMPLETIONS_URL, "chat": CHAT_URL, "responses": RESPONSES_URL}
ANSWERS = {
    200: {
        "description": "the completion object, or with `stream: true` its chunks as server-sent "
        "events ending with `data: [DONE]`",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **ONLINE_ERRORS,
    **schemas.error_responses(429),
}

router = APIRouter(
    prefix="/v1", tags=["online"], responses=schemas.V1_ERRORS, route_class=KeyedRoute
)
tokenizer = APIRouter(tags=["online"], responses=schemas.V1_ERRORS, route_class=KeyedRoute)

Json = Annotated[dict[str, Any], Body(description="as OpenAI's API takes it")]


@router.post("/completions", response_model=None, responses=ANSWERS)
async def completions(
    body: Json, state: StateDep, project: ProjectDep, request: Request
) -> Response:
    return await _complete(state, project, "completion", body, request)


@router.post("/chat/completions", response_model=None, responses=ANSWERS)
async def chat_completions(
    body: Json, state: StateDep, project: ProjectDep, request: Request
) -> Response:
    return await _complete(state, project, "chat", body, request)


@router.post("/responses", response_model=None, responses=ANSWERS)
async def responses(body: Json, state: StateDep, project: ProjectDep, request: Request) -> Response:
    """OpenAI's Responses API, answered as the chat completion it translates to; with `stream:
    true`, its typed events."""
    return await _complete(state, project, "responses", body, request)


@tokenizer.post("/tokenize", response_model=None, responses=ONLINE_ERRORS)
async def tokenize(body: Json, state: StateDep, project: ProjectDep) -> Response:
    """vLLM's: `{prompt}` or `{messages}` (and `model` when several are served) to
    `{count, max_model_len, tokens}`."""
    model = _checked(TokenizeBody, body).model
    return await _ask(state, project, "tokenize", body, model)


@tokenizer.post("/detokenize", response_model=None, responses=ONLINE_ERRORS)
async def detokenize(body: Json, state: StateDep, project: ProjectDep) -> Response:
    """vLLM's: `{tokens}` (and `model` when several are served) to `{prompt}`."""
    model = _checked(DetokenizeBody, body).model
    return await _ask(state, project, "detokenize", body, model)


@tokenizer.get("/tokenizer_info", response_model=None, responses=ONLINE_ERRORS)
async def tokenizer_info(state: StateDep, project: ProjectDep, model: str | None = None):
    """vLLM's: the served tokenizer's special tokens and chat template."""
    return await _ask(state, project, "tokenizer_info", {"model": model}, model)


async def _complete(
    state: AppState, project: str, kind: str, body: dict[str, Any], request: Request
) -> Response:
    settings = state.settings
    check_prompt_count(body, settings)
    try:
        online = parse_online_body(URLS[kind], body, max_tokens_cap=settings.max_tokens_cap or None)
    except RequestError as err:
        raise _online_error(err) from None
    check_sequences(online, settings)
    queue = await _queue_of(state, online.model)
    await check_rate(state.online, settings, project)
    lease = await OnlineLease.take(state.online, settings, project, sequences_of(online))
    try:
        message = await _send(state, queue, kind, body, project, lease)
    except BaseException:
        await lease.close()
        raise
    if online.stream:
        events = _typed_events if kind == "responses" else _events
        return LeasedStream(events(state, message, lease), lease)
    try:
        return await unless_gone(request, _one_answer(state, message, lease))
    finally:
        await lease.close()


async def _ask(
    state: AppState, project: str, kind: str, body: dict[str, Any], model: str | None
) -> Response:
    queue = await _queue_of(state, model)
    return await _one_answer(state, await _send(state, queue, kind, body, project))


async def _send(
    state: AppState,
    queue: str,
    kind: str,
    body: dict[str, Any],
    project: str,
    lease: OnlineLease | None = None,
) -> OnlineMessage:
    deadline = time.time() + state.settings.online_timeout
    message = OnlineMessage(kind, body, deadline, project)
    if lease is not None:  # before the push: a client gone while it is sent cancels it
        lease.sent(queue, message)
    await state.online.send(queue, message)
    return message


async def _one_answer(
    state: AppState, message: OnlineMessage, lease: OnlineLease | None = None
) -> Response:
    try:
        async for answer in state.online.answers(message):
            if answer.get("last"):
                if lease is not None:
                    lease.answered = True
                return JSONResponse(answer["body"], status_code=answer["status"])
    except AnswerTimeout:
        raise _timeout(state) from None
    raise APIError(502, "the worker's answer ended early", type="server_error")


async def _events(
    state: AppState, message: OnlineMessage, lease: OnlineLease
) -> AsyncIterator[bytes]:
    """The answer's chunks as server-sent events; an error after the stream began is one
    more event holding it."""
    try:
        async for answer in state.online.answers(message):
            lease.answered, lease.taken = bool(answer.get("last")), True
            for chunk in answer.get("chunks", ()):
                yield _event(chunk)
            if answer.get("status", 200) >= 400:
                yield _event(answer["body"])
    except AnswerTimeout:
        yield _event(_timeout(state).body)
    yield b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _typed_events(
    state: AppState, message: OnlineMessage, lease: OnlineLease
) -> AsyncIterator[bytes]:
    """A Responses stream: each event named in its `event:` line, an error after the stream
    began an `error` event, and no `[DONE]` at the end (as OpenAI sends it)."""
    sent = 0
    try:
        async for answer in state.online.answers(message):
            lease.answered, lease.taken = bool(answer.get("last")), True
            for event in answer.get("chunks", ()):
                sent += 1
                yield _typed_event(event)
            if answer.get("status", 200) >= 400:
                yield _typed_event(_error_event(answer["body"], sent))
    except AnswerTimeout:
        yield _typed_event(_error_event(_timeout(state).body, sent))


def _error_event(body: dict[str, Any], sequence_number: int) -> dict[str, Any]:
    error = body["error"]
    return {"type": "error", "sequence_number": sequence_number, "code": error.get("code"),
            "message": error["message"], "param": error.get("param")}  # fmt: skip


def _typed_event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


async def _queue_of(state: AppState, model: str | None) -> str:
    """The online queue of `model` (of the one model served, when None); 404 for a model no
    worker serves or served, 503 for one whose workers are all gone."""
    served = state.served.remembered(model) or await run_in_threadpool(state.served.lookup, model)
    live, known = served
    if model is None:
        listed = listed_names(sorted(live))  # as GET /v1/models names them
        if len(listed) != 1:
            raise APIError(
                400,
                f"say which model: {len(listed)} are served ({', '.join(listed) or 'none'})",
                code=INVALID_REQUEST,
                param="model",
            )
        model = listed[0]
    queue = online_queue(queue_for(model))
    in_process = state.online.has_consumer(queue)  # None: the bus reaches other processes
    if model in live and in_process is not False:
        return queue
    if model not in live and model not in known and not in_process:
        raise APIError(404, f"the model {model!r} does not exist", code=MODEL_NOT_FOUND)
    why = (
        "no live worker serves it now; retry when one is up"
        if model not in live
        else "its workers run in other processes, and online requests reach them only through "
        "Redis (set REDIS_URL)"
    )
    raise APIError(
        503,
        f"the model {model!r} cannot be served: {why}",
        code=MODEL_UNAVAILABLE,
        type="server_error",
        headers={"Retry-After": "5"},
    )


def _checked(model_cls: type[TokenizeBody] | type[DetokenizeBody], body: dict[str, Any]):
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        message, param, code = validation_message(err, prefix="")
        raise APIError(400, message, code=code, param=param or None) from None


def _online_error(err: RequestError) -> APIError:
    """A body's error, named as an online client names its fields (`temperature`, not
    `body.temperature`)."""
    param = err.param.removeprefix("body.") if err.param else None
    message = err.detail.replace('"body.', '"')
    return APIError(err.status_code, message, code=err.code, param=param)


def _timeout(state: AppState) -> APIError:
    return APIError(
        504,
        f"no answer within {state.settings.online_timeout:.0f}s (CONVEYOR_ONLINE_TIMEOUT)",
        code=TIMEOUT,
        type="server_error",
    )
