"""A checked batch line (`ParsedRequest`) as the engine takes it: the prompt (a chat's messages
through the model's chat template) and its `SamplingParams`. The worker and the offline runner
both prepare requests here."""

from __future__ import annotations

import logging
from typing import Any

from conveyor.batch_format.errors import (
    CHAT_TEMPLATE_ERROR,
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_PROMPT,
    INVALID_RESPONSE_FORMAT,
    INVALID_SAMPLING_PARAMS,
    BatchRequestError,
)
from conveyor.batch_format.request_line import ParsedRequest
from conveyor.engine.errors import (
    ContextLengthError,
    InvalidPromptError,
    InvalidRequestError,
    RequestFailure,
    StructuredOutputError,
)
from conveyor.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# SamplingParams field -> the request body field it comes from, where the names differ
_BODY_FIELD = {"prompt_logprobs": "logprobs"}

# the engine's kinds of refusal -> the error code a client sees; the most specific first (a
# kind not listed is a sampling parameter's)
ERROR_CODES: tuple[tuple[type[InvalidRequestError], str], ...] = (
    (ContextLengthError, CONTEXT_LENGTH_EXCEEDED),
    (InvalidPromptError, INVALID_PROMPT),
    (StructuredOutputError, INVALID_RESPONSE_FORMAT),
)


def internal_error(request_id: str) -> str:
    """What a client is told of a fault of the service's: no internals, and the id that the
    log line with the details carries."""
    return f"internal error (request {request_id}); the service's log has the details"


def engine_error(
    err: BaseException | RequestFailure, request: ParsedRequest, request_id: str
) -> BatchRequestError:
    """The error line (or online error) of a request the engine refused or gave up on, by the
    error's kind and field. A fault of the engine's says "internal error" and `request_id`,
    which the log line with the details carries."""
    failure = err if isinstance(err, RequestFailure) else RequestFailure.of(err)
    where = {"line": request.line, "custom_id": request.custom_id}
    kind = failure.kind
    if kind is None:  # the engine's fault
        log.error("request %s: internal error: %s", request_id, failure.message)
        return BatchRequestError(
            internal_error(request_id),
            code=INTERNAL_ERROR,
            status_code=500,
            **where,
        )
    code = next((c for k, c in ERROR_CODES if issubclass(kind, k)), INVALID_SAMPLING_PARAMS)
    if issubclass(kind, InvalidPromptError):
        param = "body.messages" if request.is_chat else "body.prompt"
    elif issubclass(kind, StructuredOutputError):
        param = "body.response_format"
    else:
        field = failure.field
        param = None if field is None else f"body.{_BODY_FIELD.get(field, field)}"
    return BatchRequestError(failure.message, code=code, param=param, **where)


def prepare_request(llm: Any, request: ParsedRequest) -> tuple[str | list[int], SamplingParams]:
    """The engine prompt and sampling params of a parsed line. Raises `BatchRequestError`."""
    try:
        params = SamplingParams(**request.sampling)
    except InvalidRequestError as err:
        raise engine_error(err, request, f"line {request.line}") from None
    if not request.is_chat:
        assert request.prompt is not None
        return request.prompt, params
    try:
        return llm.apply_chat_template(request.messages or []), params
    except Exception as err:  # template errors come in many exception types
        raise BatchRequestError(
            f"could not apply the chat template: {err}",
            code=CHAT_TEMPLATE_ERROR,
            line=request.line,
            custom_id=request.custom_id,
            param="body.messages",
        ) from None
