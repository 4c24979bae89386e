"""`POST /v1/batches`: the checks a create answers with an HTTP error, the input file's
validation, the batch's creation in the ledger, and the sending of its shards."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import IO

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conveyor.api import schemas
from conveyor.api.deps import AppState
from conveyor.api.errors import APIError
from conveyor.api.lookups import get_file
from conveyor.dispatch.celery_app import send_shards
from conveyor.dispatch.queues import queue_for
from conveyor.dispatch.routing import Router
from conveyor.ledger.batch_lifecycle import NewBatch, open_batch
from conveyor.ledger.ids import new_batch_id
from conveyor.ledger.locks import lock_project_batches
from conveyor.ledger.models import BatchRow
from conveyor.ledger.serving import note_new_batch
from conveyor.ledger.shard_lifecycle import ShardTask, mark_enqueued
from conveyor.ledger.states import TERMINAL
from conveyor.ledger.workers import workers_by_queue
from conveyor.settings import window_seconds
from conveyor.wire_format.errors import IDEMPOTENCY_KEY_REUSED, INVALID_REQUEST, TOO_MANY_BATCHES
from conveyor.wire_format.validation import Validation, validate

log = logging.getLogger(__name__)


def create_batch(
    state: AppState,
    body: schemas.BatchCreate,
    project: str,
    idempotency_key: str | None = None,
) -> str:
    """Validate the input file, store its requests in shards and enqueue them. Returns the id;
    for an idempotency key already used with the same parameters, the id of the batch created
    with it (409 if they differ)."""
    check_window(body.completion_window, state.settings.max_completion_window)
    if idempotency_key is not None:
        with state.ledger.session() as session:
            if existing := batch_for_key(session, project, idempotency_key):
                return same_request(existing, body, idempotency_key)
    try:
        return _create(state, body, project, idempotency_key)
    except IntegrityError:
        if idempotency_key is None:
            raise
        with state.ledger.session() as session:  # a concurrent create with the key won
            if existing := batch_for_key(session, project, idempotency_key):
                return same_request(existing, body, idempotency_key)
        raise


def check_window(window: str, longest: str) -> None:
    """400 for a completion window longer than the longest the service takes."""
    if window_seconds(window) > window_seconds(longest):
        raise APIError(
            400,
            f"completion_window {window!r} is longer than the limit of {longest!r} "
            "(CONVEYOR_MAX_COMPLETION_WINDOW)",
            code=INVALID_REQUEST,
            param="completion_window",
        )


def check_in_flight(session: Session, project: str, limit: int) -> None:
    """429 when the project already has `limit` unfinished batches."""
    if not limit:
        return
    running = session.execute(
        select(func.count())
        .select_from(BatchRow)
        .where(BatchRow.project == project, BatchRow.status.not_in(TERMINAL))
    ).scalar_one()
    if running >= limit:
        raise APIError(
            429,
            f"this project has {running} unfinished batches, the limit "
            f"(CONVEYOR_MAX_BATCHES_IN_FLIGHT) is {limit}; wait for one to finish or cancel one",
            code=TOO_MANY_BATCHES,
        )


def batch_for_key(session: Session, project: str, idempotency_key: str) -> BatchRow | None:
    return session.execute(
        select(BatchRow).where(
            BatchRow.project == project, BatchRow.idempotency_key == idempotency_key
        )
    ).scalar_one_or_none()


def same_request(batch: BatchRow, body: schemas.BatchCreate, idempotency_key: str) -> str:
    """The id of `batch`, made with `idempotency_key`, if `body` asks for the same batch; a
    409 naming what differs if not (a key names one request, as in payment APIs)."""
    differ = [
        name
        for name, then, now in (
            ("input_file_id", batch.input_file_id, body.input_file_id),
            ("endpoint", batch.endpoint, body.endpoint),
            ("completion_window", batch.completion_window, body.completion_window),
            ("metadata", batch.metadata_ or None, body.metadata or None),
            ("reuse", batch.reuse, body.reuse),
        )
        if then != now
    ]
    if differ:
        raise APIError(
            409,
            f"the Idempotency-Key {idempotency_key!r} was used for batch {batch.id!r} with "
            f"another {', '.join(differ)}; send the same parameters to get that batch, or use "
            "a new key for a new batch",
            code=IDEMPOTENCY_KEY_REUSED,
            param=differ[0],
        )
    return batch.id


def _create(
    state: AppState, body: schemas.BatchCreate, project: str, idempotency_key: str | None
) -> str:
    settings = state.settings
    path = _input_file(state, body, project)
    new = NewBatch(
        batch_id=new_batch_id(),
        project=project,
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        window_seconds=window_seconds(body.completion_window),
        metadata=body.metadata,
        idempotency_key=idempotency_key,
        reuse=body.reuse,
    )
    with open(path, "rb") as f:
        validation = validate(
            f,
            body.endpoint,
            settings.max_line_bytes,
            settings.max_batch_lines,
            settings.max_tokens_cap,
        )
        tasks = _open(state, new, f, validation)
    try:
        send_shards(state.celery, tasks)
    except Exception as err:  # the broker is down: the reconciler sends them when it is back
        log.warning(
            "could not enqueue the shards of %s (%s); the reconciler will", new.batch_id, err
        )
    return new.batch_id


def _input_file(state: AppState, body: schemas.BatchCreate, project: str) -> Path:
    """Where the batch's input file lies; 404 for no such file, 400 for one that is not a
    batch input, and the in-flight limit checked early, before the file's validation."""
    with state.ledger.session() as session:
        file = get_file(session, body.input_file_id, project)
        check_in_flight(session, project, state.settings.max_batches_in_flight)
        if file.purpose != "batch":
            raise APIError(
                400,
                f"file {file.id!r} has purpose {file.purpose!r}; a batch input "
                "file must be uploaded with purpose 'batch'",
                param="input_file_id",
            )
        return state.files.path(file.id)


def _open(state: AppState, new: NewBatch, f: IO[bytes], validation: Validation) -> list[ShardTask]:
    """The create transaction: the batch and its requests in the ledger, its shards marked
    sent and routed; returns the shard tasks to send once it commits."""
    settings = state.settings
    queue = queue_for(validation.model or "")
    with state.ledger.session() as session:
        if settings.max_batches_in_flight:
            # the check that counts: the count and the insert it allows in one
            # transaction, one create of the project at a time
            lock_project_batches(session, new.project)
            check_in_flight(session, new.project, settings.max_batches_in_flight)
        batch, shards = open_batch(
            session, new, f, validation, settings.shard_size, queue, settings.heartbeat_timeout
        )
        workers = workers_by_queue(session, settings.heartbeat_timeout)
        tasks = Router(workers, settings.broker_url, settings.affinity_backlog).route(
            mark_enqueued(session, shards)
        )
        if shards:
            note_new_batch(batch, served=queue in workers)
            log.info(
                "batch %s created from %s: %d requests in %d shards",
                batch.id,
                new.input_file_id,
                batch.total,
                len(shards),
            )
        return tasks
