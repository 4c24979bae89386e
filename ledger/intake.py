"""Turning an uploaded input file into a batch: validate every line, store requests in shards.

OpenAI's rules decide what fails the whole batch and what fails one line. A line that is not
JSON, lacks or repeats a `custom_id`, has the wrong `method` or a `url` other than the batch's
endpoint, has no `body` or no `body.model`, or names a different model than the other lines
fails the batch (status `failed`, every such line listed in `errors` with its number). A line
whose body is well-formed but holds bad values (a negative temperature, an empty prompt) fails
alone: it gets a line in the error file and the rest of the batch runs.

The file is read twice and never held in memory: the first pass validates and keeps a small
record per line; the second reads the valid lines back in prefix order and inserts them, so
that each shard holds requests that share a system prompt or prompt prefix.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from conveyor import openai_batch as ob
from ledger.ids import new_line_id
from ledger.models import BatchRow, RequestRow, ResultRow, ShardRow

MAX_LISTED_ERRORS = 1000
INSERT_CHUNK = 2000

# errors in these fields make the line unusable for any batch: they fail the whole batch
BATCH_FATAL_CODES = {ob.INVALID_JSON, ob.INVALID_URL, ob.INVALID_METHOD, ob.DUPLICATE_CUSTOM_ID}
BATCH_FATAL_PARAMS = {None, "custom_id", "method", "url", "body", "body.model"}
LINE_TOO_LARGE = "line_too_large"
EMPTY_FILE = "empty_file"
TOO_MANY_LINES = "too_many_requests"
MISMATCHED_MODEL = "mismatched_model"
# the ledger's column sizes: longer values fail the batch rather than the insert
CUSTOM_ID_CHARS = RequestRow.__table__.c.custom_id.type.length
MODEL_CHARS = BatchRow.__table__.c.model.type.length


@dataclass
class LineRecord:
    line: int
    offset: int
    length: int
    custom_id: str
    prefix_key: str
    error: ob.BatchRequestError | None = None  # a line-level error: reported, not run


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
                {"code": code, "message": _clean(message), "param": param, "line": line}
            )


def iter_lines(f: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, byte offset, content) for each non-blank line; content None if too long.

    Reads at most `max_line_bytes + 1` bytes of a line at a time, so a huge line costs no more
    memory than that.
    """
    offset, number = 0, 0
    while True:
        start = offset
        chunk = f.readline(max_line_bytes + 1)
        if not chunk:
            return
        number += 1
        offset += len(chunk)
        if len(chunk) > max_line_bytes and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):  # skip the rest of the long line
                chunk = f.readline(1 << 20)
                offset += len(chunk)
            yield number, start, None
            continue
        if chunk.strip():
            yield number, start, chunk


def prefix_key(request: ob.ParsedRequest) -> str:
    """What requests that can share KV blocks have in common: the system prompt, or the
    leading part of the prompt."""
    if request.messages:
        first = request.messages[0]
        lead: Any = (
            first
            if first.get("role") in ("system", "developer")
            else first.get("content", "")[:256]
        )
    elif isinstance(request.prompt, str):
        lead = request.prompt[:256]
    else:
        lead = list(request.prompt or [])[:64]
    return hashlib.blake2b(json.dumps(lead).encode(), digest_size=8).hexdigest()


def validate(
    f: IO[bytes],
    endpoint: str,
    max_line_bytes: int,
    max_lines: int,
    max_tokens_cap: int | None = None,
) -> Validation:
    result = Validation()
    parser = ob.BatchLineParser(max_tokens_cap=max_tokens_cap)
    for number, offset, raw in iter_lines(f, max_line_bytes):
        result.lines += 1
        if result.lines > max_lines:
            result.fatal(
                TOO_MANY_LINES,
                f"a batch holds at most {max_lines} requests; this file has more",
                number,
            )
            break
        if raw is None:
            result.fatal(
                LINE_TOO_LARGE, f"line is longer than the limit of {max_line_bytes} bytes", number
            )
            continue
        request: ob.ParsedRequest | None = None
        error: ob.BatchRequestError | None = None
        try:
            request = parser.parse(raw, number)
        except ob.BatchRequestError as err:
            if err.code in BATCH_FATAL_CODES or err.param in BATCH_FATAL_PARAMS:
                result.fatal(err.code, str(err), number, err.param)
                continue
            assert err.custom_id is not None  # custom_id errors are batch-fatal
            # the parser only flags a repeated custom_id on lines that parse: a repeat on a
            # line with bad values would give one custom_id two results
            first = parser.seen.get(err.custom_id)
            if first != number:
                result.fatal(
                    ob.DUPLICATE_CUSTOM_ID,
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


def _unstorable(value: str, limit: int | None) -> str | None:
    """Why the ledger cannot hold `value` in a column of `limit` characters, if it cannot."""
    if limit is not None and len(value) > limit:
        return f"is longer than {limit} characters"
    if "\x00" in value:
        return "must not contain NUL characters"
    if _clean(value) != value:
        return "must not contain lone surrogates (it is not valid Unicode)"
    return None


def _clean(text: str) -> str:
    """`text` with lone surrogates (which JSON escapes can make) written as `\\udXXX` escapes:
    the ledger stores UTF-8, which cannot encode them."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    if problem := _unstorable(custom_id, CUSTOM_ID_CHARS):
        result.fatal(
            ob.INVALID_REQUEST, f'line {number}: "custom_id" {problem}', number, "custom_id"
        )
        return False
    if url != endpoint:
        result.fatal(
            ob.INVALID_URL,
            f'line {number}: "url" {url!r} does not match the batch endpoint {endpoint!r}',
            number,
            "url",
        )
        return False
    if model is None:
        return True
    if problem := _unstorable(model, MODEL_CHARS):
        result.fatal(
            ob.INVALID_REQUEST, f'line {number}: "body.model" {problem}', number, "body.model"
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


def store_requests(
    session: Session,
    batch: BatchRow,
    f: IO[bytes],
    validation: Validation,
    shard_size: int,
    queue: str,
) -> list[ShardRow]:
    """Insert a validated file's requests (in prefix order, sharded) and its line errors."""
    good = sorted((r for r in validation.records if r.error is None), key=_order)
    bad = [r for r in validation.records if r.error is not None]
    now = time.time()

    shards: list[dict[str, Any]] = []
    shard_of: dict[int, int] = {}  # line number -> shard index
    for i, rec in enumerate(good):
        index = i // shard_size
        if i % shard_size == 0:
            shards.append(
                dict(
                    batch_id=batch.id,
                    index=index,
                    queue=queue,
                    status="queued",
                    size=0,
                    prefix_key=rec.prefix_key,
                    enqueue_count=0,
                    attempts=0,
                )
            )
        shards[-1]["size"] += 1
        shard_of[rec.line] = index
    # rows go in file order (one sequential read); the shard index carries the prefix order
    rows = (
        _request_row(batch.id, rec, raw, shard_of[rec.line])
        for rec, raw in _read_records(f, [r for r in validation.records if r.error is None])
    )
    _insert_requests(session, rows)
    if bad:
        ids = {}
        for start in range(0, len(bad), INSERT_CHUNK):
            part = bad[start : start + INSERT_CHUNK]
            returned = session.execute(
                insert(RequestRow).returning(RequestRow.id, RequestRow.line),
                [_request_row(batch.id, rec, raw, None) for rec, raw in _read_records(f, part)],
            )
            ids.update({line: rid for rid, line in returned})
        results = []
        for rec in bad:
            assert rec.error is not None
            line = ob.error_line_from_exception(rec.error)
            line["id"] = new_line_id()
            results.append(
                dict(
                    request_id=ids[rec.line],
                    batch_id=batch.id,
                    line_id=line["id"],
                    ok=False,
                    output=_clean(json.dumps(line, ensure_ascii=False)),
                    created_at=now,
                )
            )
        session.execute(insert(ResultRow), results)
        batch.failed_count = (batch.failed_count or 0) + len(results)

    if not shards:
        return []
    session.execute(insert(ShardRow), shards)
    return list(
        session.query(ShardRow).filter(ShardRow.batch_id == batch.id).order_by(ShardRow.index)
    )


def _order(rec: LineRecord) -> tuple[str, int]:
    return rec.prefix_key, rec.line


def _read_records(f: IO[bytes], records: list[LineRecord]) -> Iterator[tuple[LineRecord, str]]:
    """Each record (in file order) with its line's text."""
    for rec in sorted(records, key=lambda r: r.offset):
        f.seek(rec.offset)
        yield rec, f.read(rec.length).decode("utf-8").strip()


def _request_row(batch_id: str, rec: LineRecord, raw: str, shard: int | None) -> dict:
    return dict(
        batch_id=batch_id,
        shard_index=shard,
        line=rec.line,
        custom_id=rec.custom_id,
        raw=raw,
        attempts=0,
    )


COPY_COLUMNS = ("batch_id", "shard_index", "line", "custom_id", "raw", "attempts")


def _insert_requests(session: Session, rows: Iterator[dict[str, Any]]) -> None:
    """Bulk insert: COPY on PostgreSQL (about 3x executemany), chunked executemany elsewhere."""
    if session.get_bind().dialect.name == "postgresql":
        cursor = session.connection().connection.driver_connection.cursor()
        with cursor, cursor.copy(f"COPY requests ({', '.join(COPY_COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([row[c] for c in COPY_COLUMNS])
        return
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= INSERT_CHUNK:
            session.execute(insert(RequestRow), chunk)
            chunk = []
    if chunk:
        session.execute(insert(RequestRow), chunk)
