"""Every error code a client of Conveyor can see, each defined once, and the error of a batch
line that cannot run."""

from __future__ import annotations

import json
from typing import Any

# a batch line that cannot run (an error line, or the batch's `errors` when it fails the batch)
INVALID_JSON = "invalid_json"
INVALID_URL = "invalid_url"
INVALID_METHOD = "invalid_method"
INVALID_REQUEST = "invalid_request"
INVALID_UNICODE = "invalid_unicode"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MISMATCHED_MODEL = "mismatched_model"
MODEL_NOT_FOUND = "model_not_found"
INVALID_SAMPLING_PARAMS = "invalid_sampling_params"
UNKNOWN_PARAMETER = "unknown_parameter"  # a body field no endpoint has (or a query parameter)
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field that would change results, not built
INVALID_RESPONSE_FORMAT = "invalid_response_format"  # a constraint the grammar cannot compile
# a forced tool call whose parameters schema the grammar cannot compile (OpenAI's code)
INVALID_FUNCTION_PARAMETERS = "invalid_function_parameters"
MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
INVALID_PROMPT = "invalid_prompt"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CHAT_TEMPLATE_ERROR = "chat_template_error"

# a line that ran into trouble of the service's, not its own
INTERNAL_ERROR = "internal_error"
REQUEST_QUARANTINED = "request_quarantined"
BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"

# an input file over a limit (413 at upload; the batch fails if the limits were lowered since)
FILE_TOO_LARGE = "file_too_large"
TOO_MANY_LINES = "too_many_lines"
LINE_TOO_LARGE = "line_too_large"
EMPTY_FILE = "empty_file"

# answers of the HTTP API
NOT_FOUND = "not_found"
INVALID_API_KEY = "invalid_api_key"
REQUEST_TOO_LARGE = "request_too_large"
TOO_MANY_BATCHES = "too_many_batches"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
BATCH_NOT_CANCELLABLE = "batch_not_cancellable"
DATABASE_UNAVAILABLE = "database_unavailable"
MODEL_UNAVAILABLE = "model_unavailable"  # known, but no live worker serves it
TIMEOUT = "timeout"  # an online request not answered in time
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # a project over its online sequences (429)


class RequestError(Exception):
    """A request that cannot be run: a batch input line (`line` says which) or an online
    request's body. `str(err)` is the full, human-readable message."""

    def __init__(
        self,
        message: str,
        *,
        code: str = INVALID_REQUEST,
        line: int | None = None,
        custom_id: str | None = None,
        param: str | None = None,
        status_code: int = 400,
    ) -> None:
        self.detail = message
        self.code = code
        self.line = line
        self.custom_id = custom_id
        self.param = param
        self.status_code = status_code
        super().__init__(f"line {line}: {message}" if line is not None else message)

    @property
    def message(self) -> str:
        return str(self)


class FileLimitError(Exception):
    """An input file over one of the service's limits (`FILE_TOO_LARGE`, `TOO_MANY_LINES`,
    `LINE_TOO_LARGE`); `str(err)` says which and names the setting."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


def error_body(
    message: str,
    code: str | None = None,
    param: str | None = None,
    *,
    status: int = 400,
    type: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object, as every answer and error line carries it: its `type` is
    `invalid_request_error` for a 4xx and `server_error` for a 5xx, unless given."""
    kind = type or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe(value: Any, limit: int = 60) -> str:
    """`value` as an error message quotes it: JSON, cut to `limit` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
