"""Batch state changes. Each function runs inside the caller's transaction and re-checks the
state it starts from, so concurrent callers (API, workers, reconcilers) cannot race a batch
into two states or record a request's outcome twice.

    validating -> in_progress -> finalizing -> completed
    validating -> failed
    in_progress -> expired
    in_progress -> cancelling -> cancelled
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, and_, bindparam, case, func, or_, select, update
from sqlalchemy.orm import Session

from conveyor import openai_batch as ob
from ledger.ids import new_file_id, new_line_id
from ledger.models import BatchRow, FileRow, RequestRow, ResultRow, ShardRow

BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
TERMINAL = {"completed", "failed", "expired", "cancelled"}

# The statements a worker runs for every shard and every result commit, built once on the
# tables: building SQLAlchemy expressions (and the ORM layer around them) costs the worker
# more CPU than running them does.
_shards, _batches = ShardRow.__table__, BatchRow.__table__
_requests, _results = RequestRow.__table__, ResultRow.__table__
_CLAIM_SHARD = (
    update(_shards)
    .where(
        _shards.c.id == bindparam("shard_id"),
        _shards.c.status != "done",
        select(_batches.c.id)
        .where(_batches.c.id == _shards.c.batch_id, _batches.c.status == "in_progress")
        .exists(),
    )
    .values(
        status="running",
        worker=bindparam("by"),
        heartbeat_at=bindparam("now"),
        attempts=_shards.c.attempts + 1,
    )
    .returning(
        _shards.c.batch_id,
        _shards.c.index,
        _shards.c.prefix_key,
        select(_batches.c.model).where(_batches.c.id == _shards.c.batch_id).scalar_subquery(),
        _shards.c.attempts,
    )
)
# a run that ended cleanly (handed back on SIGTERM, its batch cancelled or expired) is no
# failure of the shard's: its claim does not count
_GIVE_BACK_ATTEMPT = (
    update(_shards)
    .where(_shards.c.id == bindparam("shard_id"), _shards.c.attempts > 0)
    .values(attempts=_shards.c.attempts - 1)
)
_HAS_RESULT = select(_results.c.seq).where(_results.c.request_id == _requests.c.id).exists()
_TAKE_REQUESTS = (
    update(_requests)
    .where(
        _requests.c.batch_id == bindparam("of_batch"),
        _requests.c.shard_index == bindparam("of_shard"),
        ~_HAS_RESULT,
    )
    .values(attempts=_requests.c.attempts + 1, worker=bindparam("by"), started_at=bindparam("now"))
    .returning(_requests.c.id, _requests.c.line, _requests.c.raw)
)
_LOCK_BATCH_HEAD = (
    select(_batches.c.status, _batches.c.expires_at)
    .where(_batches.c.id == bindparam("batch_id"))
    .with_for_update()
)
_UNFINISHED_IN_SHARD = (
    select(_requests.c.id)
    .select_from(_requests.outerjoin(_results, _results.c.request_id == _requests.c.id))
    .where(
        _requests.c.batch_id == _shards.c.batch_id,
        _requests.c.shard_index == _shards.c.index,
        _results.c.seq.is_(None),
    )
    .exists()
)
_CLOSE_SHARD = (  # done, or queued again if the batch runs on and requests are left
    update(_shards)
    .where(_shards.c.id == bindparam("shard_id"))
    .values(
        status=case(
            (and_(bindparam("batch_running"), _UNFINISHED_IN_SHARD), "queued"), else_="done"
        ),
        heartbeat_at=None,
    )
)
_OPEN_SHARD = (
    select(_shards.c.id)
    .where(_shards.c.batch_id == bindparam("batch_id"), _shards.c.status != "done")
    .limit(1)
)
_ADD_COUNTS = (
    update(_batches)
    .where(_batches.c.id == bindparam("batch_id"))
    .values(
        completed_count=_batches.c.completed_count + bindparam("completed"),
        failed_count=_batches.c.failed_count + bindparam("failed"),
        prompt_tokens=_batches.c.prompt_tokens + bindparam("prompt"),
        completion_tokens=_batches.c.completion_tokens + bindparam("completion"),
        cached_tokens=_batches.c.cached_tokens + bindparam("cached"),
    )
)
_FIRST_RESULT_AT = (
    update(_batches)
    .where(_batches.c.id == bindparam("batch_id"), _batches.c.first_result_at.is_(None))
    .values(first_result_at=bindparam("first"))
)


@dataclass
class Send:
    """A shard task to send once the transaction that enqueued it commits."""

    shard_id: int
    task_id: str
    queue: str
    prefix_key: str


@dataclass
class Counts:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed


def lock_batch(session: Session, batch_id: str) -> BatchRow | None:
    """The batch row, locked for this transaction on Postgres (SQLite locks the database)."""
    return session.execute(
        select(BatchRow).where(BatchRow.id == batch_id).with_for_update()
    ).scalar_one_or_none()


def counts(batch: BatchRow | Row[Any]) -> Counts:
    """The batch's result totals, from the running counters on its row (an ORM instance or a
    row of its columns by attribute name)."""
    return Counts(
        batch.completed_count,
        batch.failed_count,
        batch.prompt_tokens,
        batch.completion_tokens,
        batch.cached_tokens,
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
}
_PG_INSERT_RESULTS = (
    f"INSERT INTO results ({', '.join(_RESULT_PG_TYPES)}) SELECT * FROM unnest("
    + ", ".join(f"%({c})b::{t}[]" for c, t in _RESULT_PG_TYPES.items())
    + ") ON CONFLICT (request_id) DO NOTHING"
    " RETURNING batch_id, ok, prompt_tokens, completion_tokens, cached_tokens"
)
_RESULT_DEFAULTS = {"worker": None, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


def _insert_results(session: Session, rows: list[dict[str, Any]]) -> list[Any]:
    """Insert result rows, skipping requests that have one; returns the inserted rows'
    (batch_id, ok, prompt_tokens, completion_tokens, cached_tokens)."""
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
    for batch_id, ok, prompt, completion, cached in inserted:
        c = added.setdefault(batch_id, Counts())
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


def _close_unfinished(
    session: Session,
    batch_id: str,
    code: str,
    message: str,
    shard_index: int | None = None,
    status_code: int | None = None,
) -> None:
    """An error line for each request of the batch (or of one shard) that has no result."""
    now = time.time()
    rows = []
    for req in unfinished_requests(session, batch_id, shard_index):
        line = ob.build_error_line(
            req.custom_id, code, message, line=req.line, status_code=status_code
        )
        line["id"] = new_line_id()
        rows.append(
            dict(
                request_id=req.id,
                batch_id=batch_id,
                line_id=line["id"],
                ok=False,
                output=json.dumps(line, ensure_ascii=False),
                created_at=now,
            )
        )
    for start in range(0, len(rows), 2000):
        record_results(session, rows[start : start + 2000])


def _write_files(session: Session, batch: BatchRow) -> None:
    """Output and error files of a finished batch: views of its results, sized now."""
    now = int(time.time())
    for ok, purpose, attr in (
        (True, "batch_output", "output_file_id"),
        (False, "batch_error", "error_file_id"),
    ):
        n, size = session.execute(
            select(
                func.count(ResultRow.seq), func.coalesce(func.sum(func.length(ResultRow.output)), 0)
            ).where(ResultRow.batch_id == batch.id, ResultRow.ok == ok)
        ).one()
        if not n:
            continue
        file = FileRow(
            id=new_file_id(),
            project=batch.project,
            filename=f"{batch.id}_{'output' if ok else 'error'}.jsonl",
            purpose=purpose,
            bytes=int(size) + int(n),
            lines=int(n),
            created_at=now,
            batch_id=batch.id,
            deleted=False,
        )
        session.add(file)
        setattr(batch, attr, file.id)


def maybe_finalize(session: Session, batch_id: str, heartbeat_timeout: float) -> str | None:
    """Move a batch on if its work is over; returns the new status, or None if unchanged."""
    head = session.connection().execute(_LOCK_BATCH_HEAD, {"batch_id": batch_id}).first()
    if head is None:
        return None
    return _move_on(session, batch_id, head, heartbeat_timeout)


def _move_on(session: Session, batch_id: str, head: Any, heartbeat_timeout: float) -> str | None:
    """`maybe_finalize` for a batch this transaction has locked, given its (status,
    expires_at)."""
    conn = session.connection()
    now = time.time()
    status, expires_at = head
    # cheap test first (shards are few; every finished shard asks): a shard still open
    of_batch = {"batch_id": batch_id}
    if (
        status == "in_progress"
        and (expires_at is None or now < expires_at)
        and conn.execute(_OPEN_SHARD, of_batch).first() is not None
    ):
        return None
    batch = lock_batch(session, batch_id)
    if batch is None:
        return None
    if batch.status == "in_progress":
        if batch.expires_at is not None and now >= batch.expires_at:
            _close_unfinished(
                session, batch.id, BATCH_EXPIRED, "the batch expired before this request was run"
            )
            batch.status, batch.expired_at = "expired", int(now)
            _write_files(session, batch)
            _stop_shards(session, batch.id)
            return batch.status
        if conn.execute(_OPEN_SHARD, of_batch).first() is not None:
            return None
        pending = session.execute(
            select(func.count(RequestRow.id))
            .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
            .where(RequestRow.batch_id == batch.id, ResultRow.seq.is_(None))
        ).scalar_one()
        if pending:  # a shard closed with requests left: reopen it for the reconciler
            session.execute(
                update(ShardRow)
                .where(
                    ShardRow.batch_id == batch.id,
                    ShardRow.index.in_(
                        select(RequestRow.shard_index)
                        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
                        .where(RequestRow.batch_id == batch.id, ResultRow.seq.is_(None))
                    ),
                )
                .values(status="queued", enqueued_at=None)
            )
            return None
        batch.status, batch.finalizing_at = "finalizing", int(now)
        _write_files(session, batch)
        _stop_shards(session, batch.id)
        batch.status, batch.completed_at = "completed", int(time.time())
        return batch.status
    if batch.status == "cancelling":
        live = session.execute(
            select(func.count(ShardRow.id)).where(
                ShardRow.batch_id == batch.id,
                ShardRow.status == "running",
                ShardRow.heartbeat_at >= now - heartbeat_timeout,
            )
        ).scalar_one()
        if live:
            return None
        _close_unfinished(
            session,
            batch.id,
            BATCH_CANCELLED,
            "the batch was cancelled before this request was run",
        )
        _stop_shards(session, batch.id)
        batch.status, batch.cancelled_at = "cancelled", int(now)
        _write_files(session, batch)
        return batch.status
    return None


def _stop_shards(session: Session, batch_id: str) -> None:
    session.execute(
        update(ShardRow)
        .where(ShardRow.batch_id == batch_id, ShardRow.status != "done")
        .values(status="done")
    )


def cancel(session: Session, batch_id: str, heartbeat_timeout: float) -> BatchRow | None:
    """Ask a batch to stop: queued shards will not run, running ones abort their requests."""
    batch = lock_batch(session, batch_id)
    if batch is None:
        return None
    if batch.status in ("validating", "in_progress"):
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        session.execute(
            update(ShardRow)
            .where(ShardRow.batch_id == batch_id, ShardRow.status == "queued")
            .values(status="done")
        )
        session.flush()
        maybe_finalize(session, batch_id, heartbeat_timeout)
    return batch


@dataclass
class ClaimedShard:
    shard_id: int
    batch_id: str
    index: int
    model: str
    prefix_key: str
    requests: list[tuple[int, int, str]]  # (request id, line number, raw line) without results
    quarantined: bool = False  # not to be run: its requests got error lines, it is closed


def claim_shard(
    session: Session,
    shard_id: int,
    worker: str,
    max_attempts: int | None = None,
    heartbeat_timeout: float = 30.0,
) -> ClaimedShard | None:
    """Start a shard: mark it running and take its requests that have no result yet (counting
    the attempt on each). None if its batch no longer wants it run.

    Every run of a shard counts as an attempt until it ends cleanly (`give_back_attempt`): a
    shard claimed again after `max_attempts` runs that failed (their worker died or its engine
    failed) is quarantined instead, here, whatever sent it again: its unfinished requests get
    `request_quarantined` error lines and it closes (`heartbeat_timeout` is for finishing its
    batch).

    Two statements and no ORM objects: this runs once per shard, on the worker's hot path."""
    conn = session.connection()
    now = time.time()
    claimed = conn.execute(_CLAIM_SHARD, {"shard_id": shard_id, "by": worker, "now": now}).first()
    if claimed is None:
        return None
    batch_id, index, prefix_key, model, attempts = claimed
    if max_attempts is not None and attempts > max_attempts:
        _quarantine(session, shard_id, batch_id, index, max_attempts, heartbeat_timeout)
        return ClaimedShard(shard_id, batch_id, index, model or "", prefix_key, [], True)
    rows = conn.execute(
        _TAKE_REQUESTS, {"of_batch": batch_id, "of_shard": index, "by": worker, "now": now}
    ).all()
    requests = sorted((int(i), int(line), raw) for i, line, raw in rows)
    return ClaimedShard(shard_id, batch_id, index, model or "", prefix_key, requests)


def _quarantine(
    session: Session,
    shard_id: int,
    batch_id: str,
    index: int,
    failures: int,
    heartbeat_timeout: float,
) -> None:
    message = (
        f"this request was not run: the worker running its shard failed {failures} times "
        f"while running it (CONVEYOR_MAX_SHARD_ATTEMPTS={failures}), so the shard is not run "
        "again; a request in it may make the engine fail"
    )
    _close_unfinished(session, batch_id, ob.REQUEST_QUARANTINED, message, index, 500)
    close_shards(session, [(shard_id, batch_id)], heartbeat_timeout)


def give_back_attempt(session: Session, shard_id: int) -> None:
    """The shard's last run ended cleanly, not by a failure: its claim does not count toward
    quarantine."""
    session.connection().execute(_GIVE_BACK_ATTEMPT, {"shard_id": shard_id})


def shard_heartbeat(session: Session, shard_id: int) -> str | None:
    """Touch a running shard; returns its batch's status so the worker can stop early."""
    session.execute(
        update(ShardRow).where(ShardRow.id == shard_id).values(heartbeat_at=time.time())
    )
    return session.execute(
        select(BatchRow.status)
        .join(ShardRow, ShardRow.batch_id == BatchRow.id)
        .where(ShardRow.id == shard_id)
    ).scalar_one_or_none()


def close_shards(
    session: Session, shards: Iterable[tuple[int, str]], heartbeat_timeout: float
) -> None:
    """Shards that ran to their end, as (shard id, batch id): each is done if all its requests
    have results, else queued again; then each batch moves on if no shard of it is open."""
    by_batch: dict[str, list[int]] = {}
    for shard_id, batch_id in shards:
        by_batch.setdefault(batch_id, []).append(shard_id)
    conn = session.connection()
    for batch_id in sorted(by_batch):  # one lock order; each batch before its shards
        head = conn.execute(_LOCK_BATCH_HEAD, {"batch_id": batch_id}).first()
        running = head is not None and head.status == "in_progress"
        for shard_id in by_batch[batch_id]:
            conn.execute(_CLOSE_SHARD, {"shard_id": shard_id, "batch_running": running})
        if head is not None:
            _move_on(session, batch_id, head, heartbeat_timeout)


def mark_enqueued(session: Session, shards: Iterable[ShardRow]) -> list[Send]:
    """Give shards fresh task ids; returns what to send once this transaction commits."""
    now = time.time()
    out = []
    for shard in shards:
        shard.enqueue_count += 1
        shard.enqueued_at = now
        shard.status = "queued"
        out.append(Send(shard.id, shard.task_id, shard.queue, shard.prefix_key))
    return out


def batches_with_status(session: Session, *statuses: str) -> list[str]:
    return list(session.execute(select(BatchRow.id).where(BatchRow.status.in_(statuses))).scalars())


def shards_to_enqueue(
    session: Session,
    batch_id: str,
    live_task_ids: Callable[[], set[str] | None],
    grace: float,
    heartbeat_timeout: float,
) -> list[ShardRow]:
    """Shards of an in-progress batch that no broker message and no live worker carries.

    A running shard is carried while its heartbeat is fresh. A queued one is carried while it
    was sent less than `grace` seconds ago or its message is in the broker (`live_task_ids()`:
    waiting, or delivered moments ago; None for a broker we cannot look into, where a queued
    shard counts as carried). The database picks the shards in doubt, so the broker is asked
    (an expensive look at every message) only when there are some.
    """
    now = time.time()
    in_doubt = session.execute(
        select(ShardRow).where(
            ShardRow.batch_id == batch_id,
            or_(
                and_(
                    ShardRow.status == "running",
                    or_(
                        ShardRow.heartbeat_at.is_(None),
                        ShardRow.heartbeat_at < now - heartbeat_timeout,
                    ),
                ),
                and_(
                    ShardRow.status == "queued",
                    or_(ShardRow.enqueued_at.is_(None), ShardRow.enqueued_at < now - grace),
                ),
            ),
        )
    ).scalars()
    lost = []
    for shard in in_doubt:
        if shard.status == "queued" and shard.enqueued_at is not None:
            live = live_task_ids()
            if live is None or shard.task_id in live:
                continue
        lost.append(shard)
    return lost
