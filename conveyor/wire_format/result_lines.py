"""Output and error lines in the shape OpenAI's Batch API writes them, and their JSON text."""

from __future__ import annotations

import json
from typing import Any

from conveyor.wire_format.errors import RequestError, error_body
from conveyor.wire_format.request_line import ParsedRequest
from conveyor.wire_format.response_object import response_from_chat
from conveyor.wire_format.responses import chat_completion_body, new_id, text_completion_body
from conveyor.wire_format.token_text import TokenDecoder


def build_output_line(
    request: ParsedRequest,
    output: Any,
    model: str,
    decoder: TokenDecoder,
    created: int | None = None,
) -> dict[str, Any]:
    """The result line for a finished request (`output` is the engine's `RequestOutput`): a
    completion, a chat completion, or the Response of a Responses API request (made from the
    chat completion that answered it)."""
    if not request.is_chat:
        body = text_completion_body(request, output, model, decoder, created)
    else:
        body = chat_completion_body(request, output, model, decoder, created)
        if request.responses is not None:
            body = response_from_chat(request, body)
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": request.custom_id,
        "response": {
            "status_code": 200,
            "request_id": new_id(),
            "body": body,
        },
        "error": None,
    }


def reused_line(earlier: str, custom_id: str, batch_id: str, line_id: str) -> dict[str, Any]:
    """A line answered with an earlier result (`earlier`, its line's JSON text): its body as it
    was, under this line's own ids and `custom_id`, saying where it came from."""
    response = dict(json.loads(earlier)["response"])
    response["request_id"] = new_id()
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
        "reused_from": {"batch_id": batch_id, "line_id": line_id},
    }


def build_error_line(
    custom_id: str | None,
    code: str,
    message: str,
    *,
    line: int | None = None,
    param: str | None = None,
    status_code: int | None = 400,
) -> dict[str, Any]:
    """An error line.

    `error` always holds `{code, message, line, param}`. When the line named a `custom_id`,
    `response` also carries the HTTP-style error the endpoint would have answered
    (`status_code` 400 for a bad request, 500 for a server failure); for a line that could not
    be attributed to a request (not JSON, no custom_id), `response` is null.
    """
    error = {"code": code, "message": message, "line": line, "param": param}
    response = None
    if custom_id is not None and status_code is not None:
        response = {
            "status_code": status_code,
            "request_id": new_id(),
            "body": error_body(message, code, param, status=status_code),
        }
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


# Characters JSON lets a string hold as they are, but that Python's `str.splitlines` and
# httpx's `iter_lines` take for line ends (NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR): a model
# can write them, and a line holding one raw would reach such a reader as two broken halves
LINE_ENDS_IN_STRINGS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def dump_line(obj: dict[str, Any]) -> str:
    """A result or error line as JSON text that UTF-8 (a file, the ledger) can always hold and
    every reader of lines reads as one: text as it is, but for the characters some readers take
    for line ends (escaped), and unless it has a lone surrogate (model text or an echoed prompt
    can), then with every non-ASCII character escaped. It decodes to the same line."""
    text = json.dumps(obj, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(obj)
        return one_line(text)
    return text


def one_line(text: str) -> str:
    """JSON text `text` with the line ends JSON lets its strings hold escaped: the same value,
    one line for every reader (lines written before `dump_line` escaped them)."""
    for char, escaped in LINE_ENDS_IN_STRINGS.items():
        if char in text:
            text = text.replace(char, escaped)
    return text


def error_line_from_exception(err: RequestError) -> dict[str, Any]:
    return build_error_line(
        err.custom_id,
        err.code,
        str(err),
        line=err.line,
        param=err.param,
        status_code=err.status_code,
    )
