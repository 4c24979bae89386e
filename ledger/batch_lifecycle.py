"""A batch's way from creation to its end (the states are in `ledger.states`). Each function
runs inside the caller's transaction and re-checks the state it starts from under a lock on
the batch row, so concurrent callers (API, workers, reconcilers) cannot race a batch into two
states or record a request's outcome twice."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO, Any

from sqlalchemy import BLOB, Row, bindparam, cast, func, select, update
from sqlalchemy.orm import Session

from conveyor.ledger.ids import new_file_id
from conveyor.ledger.intake import store_requests
from conveyor.ledger.models import BatchRow, FileRow, RequestRow, ResultRow, ShardRow
from conveyor.ledger.results import close_unfinished
from conveyor.ledger.states import CANCELLABLE, BatchStatus, ShardStatus
from conveyor.wire_format.errors import BATCH_CANCELLED, BATCH_EXPIRED, MODEL_NOT_FOUND
from conveyor.wire_format.validation import Validation

_batches, _shards = BatchRow.__table__, ShardRow.__table__
# a batch's (status, expires_at), locked: every shard that finishes asks, so it is built once
_LOCK_BATCH_STATE = (
    select(_batches.c.status, _batches.c.expires_at)
    .where(_batches.c.id == bindparam("batch_id"))
    .with_for_update()
)
_OPEN_SHARD = (
    select(_shards.c.id)
    .where(_shards.c.batch_id == bindparam("batch_id"), _shards.c.status != ShardStatus.DONE)
    .limit(1)
)


@dataclass
class NewBatch:
    """What `open_batch` is given: a batch create call's parameters."""

    batch_id: str
    project: str
    input_file_id: str
    endpoint: str
    completion_window: str
    window_seconds: int
    metadata: dict[str, str] | None
    idempotency_key: str | None
    reuse: str | None = None  # "exact": answer lines from equal earlier results (`reuse`)


def open_batch(
    session: Session,
    new: NewBatch,
    f: IO[bytes],
    validation: Validation,
    shard_size: int,
    queue: str,
    heartbeat_timeout: float,
) -> tuple[BatchRow, list[ShardRow]]:
    """Insert a batch for a validated input file (`f`, read again for the valid lines): failed
    if validation found batch-fatal errors, else in progress with its requests in shards on
    `queue` (and already completed if every line failed alone). A repeated idempotency key
    raises IntegrityError before any request is stored."""
    now = int(time.time())
    batch = BatchRow(
        id=new.batch_id,
        project=new.project,
        input_file_id=new.input_file_id,
        endpoint=new.endpoint,
        completion_window=new.completion_window,
        model=validation.model,
        metadata_=new.metadata,
        idempotency_key=new.idempotency_key,
        reuse=new.reuse,
        created_at=now,
        total=0,
        status=BatchStatus.VALIDATING,
    )
    session.add(batch)
    session.flush()
    if validation.errors:
        batch.status, batch.failed_at, batch.errors = BatchStatus.FAILED, now, validation.errors
        return batch, []
    batch.total = len(validation.records)
    batch.status, batch.in_progress_at = BatchStatus.IN_PROGRESS, now
    batch.expires_at = now + new.window_seconds
    session.flush()
    shards = store_requests(session, batch, f, validation, shard_size, queue)
    if not shards:  # every line was rejected on its own: nothing to run
        session.flush()
        advance(session, batch.id, heartbeat_timeout)
    return batch, shards


def lock_batch(session: Session, batch_id: str) -> BatchRow | None:
    """The batch row, locked for this transaction on Postgres (SQLite locks the database)."""
    return session.execute(
        select(BatchRow).where(BatchRow.id == batch_id).with_for_update()
    ).scalar_one_or_none()


def lock_batch_state(session: Session, batch_id: str) -> Row[Any] | None:
    """The batch's (status, expires_at), its row locked for this transaction."""
    return session.connection().execute(_LOCK_BATCH_STATE, {"batch_id": batch_id}).first()


def advance(session: Session, batch_id: str, heartbeat_timeout: float) -> str | None:
    """Move a batch on if its work is over: completed, expired or cancelled; returns the new
    status, or None if unchanged."""
    state = lock_batch_state(session, batch_id)
    if state is None:
        return None
    return advance_locked(session, batch_id, state, heartbeat_timeout)


def advance_locked(
    session: Session, batch_id: str, state: Row[Any], heartbeat_timeout: float
) -> str | None:
    """`advance` for a batch whose (status, expires_at) this transaction has locked."""
    status, expires_at = state
    now = time.time()
    # cheap test first (shards are few; every finished shard asks): a shard still open
    if (
        status == BatchStatus.IN_PROGRESS
        and (expires_at is None or now < expires_at)
        and _has_open_shard(session, batch_id)
    ):
        return None
    batch = lock_batch(session, batch_id)
    if batch is None:
        return None
    if batch.status == BatchStatus.IN_PROGRESS:
        if batch.expires_at is not None and now >= batch.expires_at:
            return _expire(session, batch, now)
        return _complete_if_done(session, batch, now)
    if batch.status == BatchStatus.CANCELLING:
        return _cancel_if_stopped(session, batch, now, heartbeat_timeout)
    return None


def _has_open_shard(session: Session, batch_id: str) -> bool:
    return session.connection().execute(_OPEN_SHARD, {"batch_id": batch_id}).first() is not None


def _expire(session: Session, batch: BatchRow, now: float) -> str:
    close_unfinished(
        session, batch.id, BATCH_EXPIRED, "the batch expired before this request was run"
    )
    batch.status, batch.expired_at = BatchStatus.EXPIRED, int(now)
    _write_files(session, batch)
    _stop_shards(session, batch.id)
    return batch.status


def fail_unserved(session: Session, batch_id: str, timeout: float) -> str | None:
    """Fail an in-progress batch whose model no live worker has served for `timeout` seconds:
    each request without a result gets a `model_not_found` error line (those that ran keep
    theirs), and the batch fails with that error. Returns the new status, or None."""
    batch = lock_batch(session, batch_id)
    now = time.time()
    if (
        batch is None
        or batch.status != BatchStatus.IN_PROGRESS
        or batch.unserved_since is None
        or now - batch.unserved_since < timeout
    ):
        return None
    message = (
        f"no live worker served model {batch.model!r} for {int(now - batch.unserved_since)} s "
        "(CONVEYOR_UNSERVED_TIMEOUT); the models served are listed by GET /v1/models"
    )
    close_unfinished(session, batch.id, MODEL_NOT_FOUND, message, status_code=404)
    batch.status, batch.failed_at = BatchStatus.FAILED, int(now)
    batch.errors = [{"code": MODEL_NOT_FOUND, "message": message, "param": "model", "line": None}]
    _write_files(session, batch)
    _stop_shards(session, batch.id)
    return batch.status


def _complete_if_done(session: Session, batch: BatchRow, now: float) -> str | None:
    if _has_open_shard(session, batch.id):
        return None
    if _reopen_unfinished_shards(session, batch.id):
        return None
    batch.status, batch.finalizing_at = BatchStatus.FINALIZING, int(now)
    _write_files(session, batch)
    _stop_shards(session, batch.id)
    batch.status, batch.completed_at = BatchStatus.COMPLETED, int(time.time())
    return batch.status


def _reopen_unfinished_shards(session: Session, batch_id: str) -> bool:
    """Queue again (for the reconciler) every shard that closed with requests left; whether
    there was one."""
    unfinished = (
        select(RequestRow.shard_index)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .where(RequestRow.batch_id == batch_id, ResultRow.seq.is_(None))
    )
    if session.execute(select(func.count()).select_from(unfinished.subquery())).scalar_one() == 0:
        return False
    session.execute(
        update(ShardRow)
        .where(ShardRow.batch_id == batch_id, ShardRow.index.in_(unfinished))
        .values(status=ShardStatus.QUEUED, enqueued_at=None)
    )
    return True


def _cancel_if_stopped(
    session: Session, batch: BatchRow, now: float, heartbeat_timeout: float
) -> str | None:
    """Finish a cancelling batch once no live worker runs a shard of it."""
    live = session.execute(
        select(func.count(ShardRow.id)).where(
            ShardRow.batch_id == batch.id,
            ShardRow.status == ShardStatus.RUNNING,
            ShardRow.heartbeat_at >= now - heartbeat_timeout,
        )
    ).scalar_one()
    if live:
        return None
    close_unfinished(
        session, batch.id, BATCH_CANCELLED, "the batch was cancelled before this request was run"
    )
    _stop_shards(session, batch.id)
    batch.status, batch.cancelled_at = BatchStatus.CANCELLED, int(now)
    _write_files(session, batch)
    return batch.status


def _write_files(session: Session, batch: BatchRow) -> None:
    """Output and error files of a finished batch: views of its results, sized now."""
    now = int(time.time())
    for ok, purpose, attr in (
        (True, "batch_output", "output_file_id"),
        (False, "batch_error", "error_file_id"),
    ):
        n, size = session.execute(
            select(
                func.count(ResultRow.seq), func.coalesce(func.sum(_utf8_length(session)), 0)
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


def _utf8_length(session: Session) -> Any:
    """A result line's size in bytes as the files' content sends it (UTF-8); `length` counts
    characters."""
    if session.get_bind().dialect.name == "postgresql":
        return func.octet_length(ResultRow.output)
    return func.length(cast(ResultRow.output, BLOB))  # SQLite before 3.43 has no octet_length


def _stop_shards(session: Session, batch_id: str) -> None:
    session.execute(
        update(ShardRow)
        .where(ShardRow.batch_id == batch_id, ShardRow.status != ShardStatus.DONE)
        .values(status=ShardStatus.DONE)
    )


class NotCancellable(Exception):
    """The batch has ended otherwise than by a cancel (completed, failed, expired)."""

    def __init__(self, batch: BatchRow) -> None:
        self.status = batch.status
        super().__init__(f"batch {batch.id!r} is {batch.status} and cannot be cancelled")


def cancel(session: Session, batch_id: str, heartbeat_timeout: float) -> BatchRow | None:
    """Ask a batch to stop: queued shards will not run, running ones abort their requests.
    A batch already cancelling or cancelled is returned as it is; one that ended otherwise
    raises `NotCancellable`. None if there is no such batch."""
    batch = lock_batch(session, batch_id)
    if batch is None or batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return batch
    if batch.status not in CANCELLABLE:
        raise NotCancellable(batch)
    batch.status, batch.cancelling_at = BatchStatus.CANCELLING, int(time.time())
    session.execute(
        update(ShardRow)
        .where(ShardRow.batch_id == batch_id, ShardRow.status == ShardStatus.QUEUED)
        .values(status=ShardStatus.DONE)
    )
    session.flush()
    advance(session, batch_id, heartbeat_timeout)
    return batch


def batches_with_status(session: Session, *statuses: str) -> list[str]:
    return list(session.execute(select(BatchRow.id).where(BatchRow.status.in_(statuses))).scalars())
