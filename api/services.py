"""The work behind the routes: creating batches from files and describing batches."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import Row, bindparam, func, inspect, select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api import schemas
from api.deps import AppState
from api.errors import APIError, not_found
from conveyor.settings import window_seconds
from ledger import intake
from ledger import transitions as tr
from ledger.ids import new_batch_id
from ledger.locks import lock_project_batches
from ledger.models import BatchRow, FileRow
from worker.celery_app import queue_for, send_shards
from worker.routing import Router, live_workers

log = logging.getLogger(__name__)


def get_file(session: Session, file_id: str, project: str) -> FileRow:
    """The file, if it exists and belongs to `project` (else 404: another project's ids do
    not exist for this one)."""
    file = session.get(FileRow, file_id)
    if file is None or file.deleted or file.project != project:
        raise not_found("file", file_id)
    return file


def get_batch(session: Session, batch_id: str, project: str) -> BatchRow:
    batch = session.get(BatchRow, batch_id)
    if batch is None or batch.project != project:
        raise not_found("batch", batch_id)
    return batch


def check_in_flight(session: Session, project: str, limit: int) -> None:
    """429 when the project already has `limit` unfinished batches."""
    if not limit:
        return
    running = session.execute(
        select(func.count())
        .select_from(BatchRow)
        .where(BatchRow.project == project, BatchRow.status.not_in(tr.TERMINAL))
    ).scalar_one()
    if running >= limit:
        raise APIError(
            429,
            f"this project has {running} unfinished batches, the limit "
            f"(CONVEYOR_MAX_BATCHES_IN_FLIGHT) is {limit}; wait for one to finish or cancel one",
            code="too_many_batches",
        )


def check_window(window: str, longest: str) -> None:
    """400 for a completion window longer than the longest the service takes."""
    if window_seconds(window) > window_seconds(longest):
        raise APIError(
            400,
            f"completion_window {window!r} is longer than the limit of {longest!r} "
            "(CONVEYOR_MAX_COMPLETION_WINDOW)",
            code="invalid_request",
            param="completion_window",
        )


def batch_for_key(session: Session, project: str, idempotency_key: str) -> BatchRow | None:
    return session.execute(
        select(BatchRow).where(
            BatchRow.project == project, BatchRow.idempotency_key == idempotency_key
        )
    ).scalar_one_or_none()


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
        return _create_batch(state, body, project, idempotency_key)
    except IntegrityError:
        if idempotency_key is None:
            raise
        with state.ledger.session() as session:  # a concurrent create with the key won
            if existing := batch_for_key(session, project, idempotency_key):
                return same_request(existing, body, idempotency_key)
        raise


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
        )
        if then != now
    ]
    if differ:
        raise APIError(
            409,
            f"the Idempotency-Key {idempotency_key!r} was used for batch {batch.id!r} with "
            f"another {', '.join(differ)}; send the same parameters to get that batch, or use "
            "a new key for a new batch",
            code="idempotency_key_reused",
            param=differ[0],
        )
    return batch.id


def _create_batch(
    state: AppState, body: schemas.BatchCreate, project: str, idempotency_key: str | None
) -> str:
    settings = state.settings
    with state.ledger.session() as session:
        file = get_file(session, body.input_file_id, project)
        # early, to spare the file's validation when the project is already at its limit
        check_in_flight(session, project, settings.max_batches_in_flight)
        if file.purpose != "batch":
            raise APIError(
                400,
                f"file {file.id!r} has purpose {file.purpose!r}; a batch input "
                "file must be uploaded with purpose 'batch'",
                param="input_file_id",
            )
        path = state.files.path(file.id)
    now = int(time.time())
    batch_id = new_batch_id()
    with open(path, "rb") as f:
        validation = intake.validate(
            f,
            body.endpoint,
            settings.max_line_bytes,
            settings.max_batch_lines,
            settings.max_tokens_cap,
        )
        sends = []
        with state.ledger.session() as session:
            if settings.max_batches_in_flight:
                # the check that counts: the count and the insert it allows in one
                # transaction, one create of the project at a time
                lock_project_batches(session, project)
                check_in_flight(session, project, settings.max_batches_in_flight)
            batch = BatchRow(
                id=batch_id,
                project=project,
                input_file_id=file.id,
                endpoint=body.endpoint,
                completion_window=body.completion_window,
                model=validation.model,
                metadata_=body.metadata,
                idempotency_key=idempotency_key,
                created_at=now,
                total=0,
                status="validating",
            )
            session.add(batch)
            session.flush()  # a repeated idempotency key fails here, before requests are stored
            if validation.errors:
                batch.status, batch.failed_at, batch.errors = "failed", now, validation.errors
                return batch_id
            batch.total = len(validation.records)
            batch.status, batch.in_progress_at = "in_progress", now
            batch.expires_at = now + window_seconds(body.completion_window)
            session.flush()
            shards = intake.store_requests(
                session,
                batch,
                f,
                validation,
                settings.shard_size,
                queue_for(validation.model or ""),
            )
            workers = live_workers(session, settings.heartbeat_timeout)
            sends = Router(workers, settings.broker_url, settings.affinity_backlog).route(
                tr.mark_enqueued(session, shards)
            )
            if shards and queue_for(validation.model or "") not in workers:
                batch.unserved_since = time.time()  # said at once, not at the next reconcile
            log.info(
                "batch %s created from %s: %d requests in %d shards",
                batch_id,
                file.id,
                batch.total,
                len(shards),
            )
            if not shards:  # every line was rejected on its own: nothing to run
                session.flush()
                tr.maybe_finalize(session, batch_id, settings.heartbeat_timeout)
    try:
        send_shards(state.celery, sends)
    except Exception as err:  # the broker is down: the reconciler sends them when it is back
        log.warning("could not enqueue the shards of %s (%s); the reconciler will", batch_id, err)
    return batch_id


# The batch row's columns as a plain select (each labelled with its attribute name, so a
# result row reads like a BatchRow): the status poll is the API's most frequent call, and a
# Core row costs it less than an ORM instance with its identity-map and attribute state.
_BATCH_FIELDS = select(*(a.columns[0].label(a.key) for a in inspect(BatchRow).column_attrs))
_BATCH_BY_ID = _BATCH_FIELDS.where(BatchRow.id == bindparam("batch_id"))


def read_batch(session: Session, batch_id: str, project: str) -> schemas.Batch:
    """The batch object, if the batch exists and belongs to `project` (else 404)."""
    batch = session.execute(_BATCH_BY_ID, {"batch_id": batch_id}).first()
    if batch is None or batch.project != project:
        raise not_found("batch", batch_id)
    return batch_object(batch)


def batch_list(
    session: Session, project: str, after: str | None, limit: int, idempotency_key: str | None
) -> schemas.BatchList:
    """A page of the project's batches, newest first, after the batch `after`."""
    query = _BATCH_FIELDS.where(BatchRow.project == project)
    if idempotency_key is not None:
        query = query.where(BatchRow.idempotency_key == idempotency_key)
    if after:
        cursor = session.execute(
            select(BatchRow.created_at, BatchRow.id).where(
                BatchRow.id == after, BatchRow.project == project
            )
        ).first()
        if cursor is not None:
            query = query.where(tuple_(BatchRow.created_at, BatchRow.id) < tuple_(*cursor))
    order = (BatchRow.created_at.desc(), BatchRow.id.desc())
    rows = session.execute(query.order_by(*order).limit(limit + 1)).all()
    return schemas.list_page(schemas.BatchList, rows, limit, batch_object)


def batch_object(batch: BatchRow | Row[Any]) -> schemas.Batch:
    counts = tr.counts(batch)
    total = batch.total
    progress = 1.0 if batch.status in tr.TERMINAL else (counts.done / total if total else 0.0)
    eta = None
    if batch.status == "in_progress" and batch.first_result_at and 0 < counts.done < total:
        elapsed = max(time.time() - batch.first_result_at, 1e-3)
        eta = round((total - counts.done) * elapsed / counts.done, 1)
    errors = None
    if batch.errors:
        errors = schemas.BatchErrors(data=[schemas.BatchError(**e) for e in batch.errors])
    return schemas.Batch(
        id=batch.id,
        endpoint=batch.endpoint,
        errors=errors,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=batch.created_at,
        in_progress_at=batch.in_progress_at,
        expires_at=batch.expires_at,
        finalizing_at=batch.finalizing_at,
        completed_at=batch.completed_at,
        failed_at=batch.failed_at,
        expired_at=batch.expired_at,
        cancelling_at=batch.cancelling_at,
        cancelled_at=batch.cancelled_at,
        request_counts=schemas.RequestCounts(
            total=total, completed=counts.completed, failed=counts.failed
        ),
        metadata=batch.metadata_,
        usage=schemas.Usage(
            input_tokens=counts.prompt_tokens,
            input_tokens_details=schemas.InputTokensDetails(cached_tokens=counts.cached_tokens),
            output_tokens=counts.completion_tokens,
            total_tokens=counts.prompt_tokens + counts.completion_tokens,
        ),
        model=batch.model,
        progress=round(progress, 4),
        eta_seconds=eta,
        cached_tokens=counts.cached_tokens,
        status_details=_status_details(batch),
    )


def _status_details(batch: BatchRow | Row[Any]) -> str | None:
    if batch.status != "in_progress" or batch.unserved_since is None:
        return None
    waited = int(time.time() - batch.unserved_since)
    return (
        f"no live worker serves model {batch.model!r} (for {waited}s); the batch waits for "
        "one until it expires: start a worker with this model or served model name"
    )
