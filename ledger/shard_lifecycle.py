"""A shard's runs: claimed by a worker, heartbeated, closed (done, or queued again), handed back,
quarantined after failing too often, and re-sent by the reconciler when nothing carries it.

The statements a worker runs for every shard are built once on the tables: building
SQLAlchemy expressions (and the ORM layer around them) costs the worker more CPU than running
them does."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import and_, bindparam, case, or_, select, update
from sqlalchemy.orm import Session

from conveyor.ledger.batch_lifecycle import advance_locked, lock_batch_state
from conveyor.ledger.models import BatchRow, RequestRow, ResultRow, ShardRow, shard_of_task
from conveyor.ledger.results import close_unfinished
from conveyor.ledger.states import BatchStatus, ShardStatus
from conveyor.wire_format.errors import REQUEST_QUARANTINED

_shards, _batches = ShardRow.__table__, BatchRow.__table__
_requests, _results = RequestRow.__table__, ResultRow.__table__
_CLAIM_SHARD = (
    update(_shards)
    .where(
        _shards.c.id == bindparam("shard_id"),
        _shards.c.status != ShardStatus.DONE,
        select(_batches.c.id)
        .where(_batches.c.id == _shards.c.batch_id, _batches.c.status == BatchStatus.IN_PROGRESS)
        .exists(),
    )
    .values(
        status=ShardStatus.RUNNING,
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
        select(_batches.c.project).where(_batches.c.id == _shards.c.batch_id).scalar_subquery(),
        select(_batches.c.reuse).where(_batches.c.id == _shards.c.batch_id).scalar_subquery(),
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
    .returning(_requests.c.id, _requests.c.line, _requests.c.raw, _requests.c.engine_failures)
)
_ADD_ENGINE_FAILURE = (
    update(_requests)
    .where(_requests.c.id.in_(bindparam("ids", expanding=True)))
    .values(engine_failures=_requests.c.engine_failures + 1)
)
# a shard whose task ended without running it (handed back unclaimed): its message is spent
_FORGET_MESSAGE = (
    update(_shards)
    .where(_shards.c.id == bindparam("shard_id"), _shards.c.status == ShardStatus.QUEUED)
    .values(enqueued_at=None)
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
            (and_(bindparam("batch_running"), _UNFINISHED_IN_SHARD), ShardStatus.QUEUED),
            else_=ShardStatus.DONE,
        ),
        heartbeat_at=None,
        # its task ends now: no broker message carries it, so the reconciler sends it again
        enqueued_at=None,
    )
)


@dataclass
class ShardTask:
    """A shard task to send once the transaction that enqueued it commits."""

    shard_id: int
    task_id: str
    queue: str
    prefix_key: str


@dataclass
class ClaimedShard:
    shard_id: int
    batch_id: str
    index: int
    model: str
    prefix_key: str
    # (request id, line number, raw line, engine failures) of those without results
    requests: list[tuple[int, int, str, int]]
    quarantined: bool = False  # not to be run: its requests got error lines, it is closed
    project: str = ""
    reuse: str | None = None  # the batch's reuse mode ("exact"), None: compute every line


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
    batch_id, index, prefix_key, model, attempts, project, reuse = claimed
    if max_attempts is not None and attempts > max_attempts:
        _quarantine(session, shard_id, batch_id, index, max_attempts, heartbeat_timeout)
        return ClaimedShard(shard_id, batch_id, index, model or "", prefix_key, [], True, project)
    rows = conn.execute(
        _TAKE_REQUESTS, {"of_batch": batch_id, "of_shard": index, "by": worker, "now": now}
    ).all()
    requests = sorted((int(i), int(line), raw, int(fails or 0)) for i, line, raw, fails in rows)
    return ClaimedShard(
        shard_id, batch_id, index, model or "", prefix_key, requests, False, project, reuse
    )


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
    close_unfinished(session, batch_id, REQUEST_QUARANTINED, message, index, 500)
    close_shards(session, [(shard_id, batch_id)], heartbeat_timeout)


def record_engine_failure(session: Session, request_ids: list[int]) -> None:
    """These requests were in the engine's step when it failed: each counts one more engine
    death against it (`ClaimedShard.requests` carries the count to the next run)."""
    if request_ids:
        session.connection().execute(_ADD_ENGINE_FAILURE, {"ids": request_ids})


def forget_message(session: Session, shard_id: int) -> None:
    """The task of a queued shard ended without claiming it: no broker message carries it now,
    so the reconciler sends it again."""
    session.connection().execute(_FORGET_MESSAGE, {"shard_id": shard_id})


def forget_tasks(session: Session, task_ids: Iterable[str]) -> int:
    """`forget_message` for the shards of these task ids (`ShardRow.task_id`) that are queued
    under that very task, not sent again since; returns how many."""
    forgotten = 0
    for task_id in task_ids:
        if (task := shard_of_task(task_id)) is None:
            continue
        shard_id, count = task
        done = session.connection().execute(
            _FORGET_MESSAGE.where(_shards.c.enqueue_count == count), {"shard_id": shard_id}
        )
        forgotten += done.rowcount
    return forgotten


def give_back_attempt(session: Session, shard_id: int) -> None:
    """The shard's last run ended cleanly, not by a failure: its claim does not count toward
    quarantine."""
    session.connection().execute(_GIVE_BACK_ATTEMPT, {"shard_id": shard_id})


def shard_heartbeat(session: Session, shard_id: int) -> str | None:
    """Touch a running shard; returns its batch's status so the worker can stop early. A
    heartbeat that arrives after its run closed the shard touches nothing."""
    session.execute(
        update(ShardRow)
        .where(ShardRow.id == shard_id, ShardRow.status == ShardStatus.RUNNING)
        .values(heartbeat_at=time.time())
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
        state = lock_batch_state(session, batch_id)
        running = state is not None and state.status == BatchStatus.IN_PROGRESS
        for shard_id in by_batch[batch_id]:
            conn.execute(_CLOSE_SHARD, {"shard_id": shard_id, "batch_running": running})
        if state is not None:
            advance_locked(session, batch_id, state, heartbeat_timeout)


def mark_enqueued(session: Session, shards: Iterable[ShardRow]) -> list[ShardTask]:
    """Give shards fresh task ids; returns what to send once this transaction commits."""
    now = time.time()
    out = []
    for shard in shards:
        shard.enqueue_count += 1
        shard.enqueued_at = now
        shard.status = ShardStatus.QUEUED
        out.append(ShardTask(shard.id, shard.task_id, shard.queue, shard.prefix_key))
    return out


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
                    ShardRow.status == ShardStatus.RUNNING,
                    or_(
                        ShardRow.heartbeat_at.is_(None),
                        ShardRow.heartbeat_at < now - heartbeat_timeout,
                    ),
                ),
                and_(
                    ShardRow.status == ShardStatus.QUEUED,
                    or_(ShardRow.enqueued_at.is_(None), ShardRow.enqueued_at < now - grace),
                ),
            ),
        )
    ).scalars()
    lost = []
    for shard in in_doubt:
        if shard.status == ShardStatus.QUEUED and shard.enqueued_at is not None:
            live = live_task_ids()
            if live is None or shard.task_id in live:
                continue
        lost.append(shard)
    return lost
