"""A whole input file checked by OpenAI's rules, one streaming pass that keeps a small record
per line.

A line that is not JSON, lacks or repeats a `custom_id`, has the wrong `method` or a `url`
other than the batch's endpoint, has no `body` or no `body.model`, or names a different model
than the other lines fails the whole batch (every such line listed with its number). A line
whose body is well-formed but holds bad values (a negative temperature, an empty prompt) fails
alone: it gets a line in the error file and the rest of the batch runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any

from conveyor.wire_format.errors import (
    DUPLICATE_CUSTOM_ID,
    EMPTY_FILE,
    INVALID_JSON,
    INVALID_METHOD,
    INVALID_REQUEST,
    INVALID_URL,
    LINE_TOO_LARGE,
    MISMATCHED_MODEL,
    RequestError,
)
from conveyor.wire_format.lines import iter_lines, too_many_lines
from conveyor.wire_format.prefix import prefix_key
from conveyor.wire_format.request_line import BatchLineParser, ParsedRequest
from conveyor.wire_format.text import escape_surrogates, unstorable

MAX_LISTED_ERRORS = 1000


# errors in these fields make the line unusable for any batch: they fail the whole batch
BATCH_FATAL_CODES = {INVALID_JSON, INVALID_URL, INVALID_METHOD, DUPLICATE_CUSTOM_ID}


BATCH_FATAL_PARAMS = {None, "custom_id", "method", "url", "body", "body.model"}

# the longest custom_id and model a batch can hold (the ledger's columns are this wide)
CUSTOM_ID_MAX_CHARS = 512
MODEL_MAX_CHARS = 512


@dataclass
class LineRecord:
    line: int
    offset: int
    length: int
    custom_id: str
    prefix_key: str
    error: RequestError | None = None  # a line-level error: reported, not run


@dataclass
class Validation:
    records: list[LineRecord] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)  # batch-fatal, OpenAI's shape
    num_errors: int = 0
    model: str | None = None
    lines: int = 0

    def fatal(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(
                {"code": code, "message": escape_surrogates(message), "param": param, "line": line}
            )


def validate(
    f: IO[bytes],
    endpoint: str,
    max_line_bytes: int,
    max_lines: int,
    max_tokens_cap: int | None = None,
) -> Validation:
    result = Validation()
    parser = BatchLineParser(max_tokens_cap=max_tokens_cap)
    for number, offset, raw in iter_lines(f, max_line_bytes):
        result.lines += 1
        if result.lines > max_lines:
            err = too_many_lines(max_lines)
            result.fatal(err.code, str(err), number)
            break
        if raw is None:
            result.fatal(
                LINE_TOO_LARGE, f"line is longer than the limit of {max_line_bytes} bytes", number
            )
            continue
        request: ParsedRequest | None = None
        error: RequestError | None = None
        try:
            request = parser.parse(raw, number)
        except RequestError as err:
            if err.code in BATCH_FATAL_CODES or err.param in BATCH_FATAL_PARAMS:
                result.fatal(err.code, str(err), number, err.param)
                continue
            assert err.custom_id is not None  # custom_id errors are batch-fatal
            # the parser only flags a repeated custom_id on lines that parse: a repeat on a
            # line with bad values would give one custom_id two results
            first = parser.seen.get(err.custom_id)
            if first != number:
                result.fatal(
                    DUPLICATE_CUSTOM_ID,
                    f'line {number}: duplicate "custom_id" {json.dumps(err.custom_id)} '
                    f"(first used on line {first})",
                    number,
                    "custom_id",
                )
                continue
            error, custom_id = err, err.custom_id
            url, model = _url_and_model(raw)
        else:
            custom_id, url, model = request.custom_id, request.url, request.model
        if not _check_batch_fields(result, endpoint, number, custom_id, url, model):
            continue
        key = prefix_key(request) if request is not None else ""
        result.records.append(LineRecord(number, offset, len(raw), custom_id, key, error))
    if result.lines == 0:
        result.fatal(EMPTY_FILE, "the input file has no requests", None)
    return result


def _url_and_model(raw: bytes) -> tuple[str | None, str | None]:
    """`url` and `body.model` of a line that is a JSON object (one the parser got into)."""
    obj = json.loads(raw)
    body = obj.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return obj.get("url"), model if isinstance(model, str) else None


def _check_batch_fields(
    result: Validation,
    endpoint: str,
    number: int,
    custom_id: str,
    url: str | None,
    model: str | None,
) -> bool:
    """Whether the line's `custom_id`, `url` and `body.model` fit the batch and the ledger;
    if not, a batch-fatal error."""
    if problem := unstorable(custom_id, CUSTOM_ID_MAX_CHARS):
        result.fatal(INVALID_REQUEST, f'line {number}: "custom_id" {problem}', number, "custom_id")
        return False
    if url != endpoint:
        result.fatal(
            INVALID_URL,
            f'line {number}: "url" {url!r} does not match the batch endpoint {endpoint!r}',
            number,
            "url",
        )
        return False
    if model is None:
        return True
    if problem := unstorable(model, MODEL_MAX_CHARS):
        result.fatal(
            INVALID_REQUEST, f'line {number}: "body.model" {problem}', number, "body.model"
        )
        return False
    if result.model is None:
        result.model = model
    elif model != result.model:
        result.fatal(
            MISMATCHED_MODEL,
            f'line {number}: "body.model" is {model!r} but earlier lines use '
            f"{result.model!r}; all requests of a batch must use the same model",
            number,
            "body.model",
        )
        return False
    return True
