"""A request's outcome: one `results` row, recorded at most once, and the running totals on its
batch that the same transaction keeps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, bindparam, select, update
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow, RequestRow, ResultRow
from conveyor.wire_format.result_lines import build_error_line, dump_line

INSERT_CHUNK = 2000  # rows per statement when many error lines go in at once

_batches = BatchRow.__table__
_ADD_COUNTS = (
    update(_batches)
    .where(_batches.c.id == bindparam("batch_id"))
    .values(
        completed_count=_batches.c.completed_count + bindparam("completed"),
        failed_count=_batches.c.failed_count + bindparam("failed"),
        prompt_tokens=_batches.c.prompt_tokens + bindparam("prompt"),
        completion_tokens=_batches.c.completion_tokens + bindparam("completion"),
        cached_tokens=_batches.c.cached_tokens + bindparam("cached"),
        reused_count=_batches.c.reused_count + bindparam("reused"),
    )
)
_FIRST_RESULT_AT = (
    update(_batches)
    .where(_batches.c.id == bindparam("batch_id"), _batches.c.first_result_at.is_(None))
    .values(first_result_at=bindparam("first"))
)


def result_row(
    request_id: int,
    batch_id: str,
    line: dict[str, Any],
    *,
    ok: bool = False,
    worker: str | None = None,
    created_at: float | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    fingerprint: str | None = None,
    request_key: str | None = None,
    reused: bool = False,
) -> dict[str, Any]:
    """The `results` row of a request's result or error line: keyed by the line's own `id`
    (what `?after=` takes), holding the line as JSON text the ledger can store."""
    return dict(
        request_id=request_id,
        batch_id=batch_id,
        line_id=line["id"],
        ok=ok,
        output=dump_line(line),
        worker=worker,
        created_at=time.time() if created_at is None else created_at,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        fingerprint=fingerprint,
        request_key=request_key,
        reused=reused,
    )


@dataclass
class Counts:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reused: int = 0  # of the completed, answered from an earlier batch's results

    @property
    def done(self) -> int:
        return self.completed + self.failed


def counts(batch: BatchRow | Row[Any]) -> Counts:
    """The batch's result totals, from the running counters on its row (an ORM instance or a
    row of its columns by attribute name)."""
    return Counts(
        batch.completed_count,
        batch.failed_count,
        batch.prompt_tokens,
        batch.completion_tokens,
        batch.cached_tokens,
        batch.reused_count,
    )


# One statement whose text never changes, with one array per column sent in binary: no
# multi-row VALUES list to build and parse, and no per-element quoting of the JSON outputs
# (text-format arrays escape every quote; this is over 10x cheaper for the worker).
_RESULT_PG_TYPES = {
    "request_id": "bigint",
    "batch_id": "varchar",
    "line_id": "varchar",
    "ok": "boolean",
    "output": "text",
    "worker": "varchar",
    "created_at": "double precision",
    "prompt_tokens": "integer",
    "completion_tokens": "integer",
    "cached_tokens": "integer",
    "fingerprint": "varchar",
    "request_key": "varchar",
    "reused": "boolean",
}
_PG_INSERT_RESULTS = (
    f"INSERT INTO results ({', '.join(_RESULT_PG_TYPES)}) SELECT * FROM unnest("
    + ", ".join(f"%({c})b::{t}[]" for c, t in _RESULT_PG_TYPES.items())
    + ") ON CONFLICT (request_id) DO NOTHING"
    " RETURNING batch_id, ok, prompt_tokens, completion_tokens, cached_tokens, reused"
)
_RESULT_DEFAULTS = {"worker": None, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                    "fingerprint": None, "request_key": None, "reused": False}  # fmt: skip


def _insert_results(session: Session, rows: list[dict[str, Any]]) -> list[Any]:
    """Insert result rows, skipping requests that have one; returns the inserted rows'
    (batch_id, ok, prompt_tokens, completion_tokens, cached_tokens, reused)."""
    if session.get_bind().dialect.name == "postgresql":
        arrays = {c: [r.get(c, _RESULT_DEFAULTS.get(c)) for r in rows] for c in _RESULT_PG_TYPES}
        # psycopg's own cursor, on the session's connection and transaction: binary
        # parameters (%b) are not something SQLAlchemy's text() can ask for
        with session.connection().connection.cursor() as cursor:
            cursor.execute(_PG_INSERT_RESULTS, arrays)
            return cursor.fetchall()
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    stmt = (
        sqlite_insert(ResultRow)
        .on_conflict_do_nothing(index_elements=["request_id"])
        .returning(
            ResultRow.batch_id,
            ResultRow.ok,
            ResultRow.prompt_tokens,
            ResultRow.completion_tokens,
            ResultRow.cached_tokens,
            ResultRow.reused,
        )
    )
    return list(session.execute(stmt, rows).all())


def record_results(
    session: Session, rows: list[dict[str, Any]], started: set[str] | None = None
) -> None:
    """Insert result rows; a request that already has a result keeps its first one.

    `started` holds batch ids known to have their first result already (their
    `first_result_at` is not touched again).
    """
    if not rows:
        return
    inserted = _insert_results(session, rows)  # a request that had a result: not here
    first = min(r["created_at"] for r in rows)
    fresh = {r["batch_id"] for r in rows} - (started or set())
    added: dict[str, Counts] = {}
    for batch_id, ok, prompt, completion, cached, reused in inserted:
        c = added.setdefault(batch_id, Counts())
        c.reused += bool(reused)
        c.completed += bool(ok)
        c.failed += not ok
        c.prompt_tokens += prompt or 0
        c.completion_tokens += completion or 0
        c.cached_tokens += cached or 0
    for batch_id in sorted(fresh | set(added)):  # one lock order: no deadlocks
        add_counts(session, batch_id, added.get(batch_id, Counts()))
        if batch_id in fresh:
            session.connection().execute(_FIRST_RESULT_AT, {"batch_id": batch_id, "first": first})


def add_counts(session: Session, batch_id: str, c: Counts) -> None:
    if not (c.done or c.prompt_tokens or c.completion_tokens):
        return
    session.connection().execute(
        _ADD_COUNTS,
        {
            "batch_id": batch_id,
            "completed": c.completed,
            "failed": c.failed,
            "prompt": c.prompt_tokens,
            "completion": c.completion_tokens,
            "cached": c.cached_tokens,
            "reused": c.reused,
        },
    )


def unfinished_requests(session: Session, batch_id: str, shard_index: int | None = None):
    """Requests of the batch (or of one shard) that have no result yet."""
    query = (
        select(RequestRow)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .where(RequestRow.batch_id == batch_id, ResultRow.seq.is_(None))
    )
    if shard_index is not None:
        query = query.where(RequestRow.shard_index == shard_index)
    return session.execute(query.order_by(RequestRow.id)).scalars()


def close_unfinished(
    session: Session,
    batch_id: str,
    code: str,
    message: str,
    shard_index: int | None = None,
    status_code: int | None = None,
) -> None:
    """An error line for each request of the batch (or of one shard) that has no result."""
    now = time.time()
    rows = [
        result_row(
            req.id,
            batch_id,
            build_error_line(req.custom_id, code, message, line=req.line, status_code=status_code),
            created_at=now,
        )
        for req in unfinished_requests(session, batch_id, shard_index)
    ]
    for start in range(0, len(rows), INSERT_CHUNK):
        record_results(session, rows[start : start + INSERT_CHUNK])
