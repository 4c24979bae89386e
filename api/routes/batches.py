"""`/v1/batches`: create, list, retrieve and cancel batches; stream partial results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select, tuple_

from api import schemas
from api.deps import ProjectDep, SessionDep, StateDep
from api.errors import APIError
from api.routes.files import result_lines
from api.services import batch_object, create_batch, get_batch
from ledger import transitions as tr
from ledger.models import BatchRow, ResultRow

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=schemas.V1_ERRORS)


@router.post("", response_model=schemas.Batch, responses=schemas.error_responses(429))
async def create(
    body: schemas.BatchCreate,
    state: StateDep,
    project: ProjectDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> schemas.Batch:
    """With an `Idempotency-Key` header, a create that repeats a key returns the batch first
    created with it instead of creating another."""
    batch_id = await run_in_threadpool(create_batch, state, body, project, idempotency_key)
    with state.ledger.session() as session:
        return batch_object(session, get_batch(session, batch_id, project))


@router.get("", response_model=schemas.BatchList)
def list_batches(
    session: SessionDep,
    project: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    idempotency_key: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
) -> schemas.BatchList:
    query = select(BatchRow).where(BatchRow.project == project)
    if idempotency_key is not None:
        query = query.where(BatchRow.idempotency_key == idempotency_key)
    if after:
        cursor = session.get(BatchRow, after)
        if cursor is not None and cursor.project == project:
            query = query.where(
                tuple_(BatchRow.created_at, BatchRow.id) < tuple_(cursor.created_at, cursor.id)
            )
    rows = list(
        session.execute(
            query.order_by(BatchRow.created_at.desc(), BatchRow.id.desc()).limit(limit + 1)
        ).scalars()
    )
    data = [batch_object(session, b) for b in rows[:limit]]
    return schemas.BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(rows) > limit,
    )


@router.get("/{batch_id}", response_model=schemas.Batch)
def retrieve(batch_id: str, session: SessionDep, project: ProjectDep) -> schemas.Batch:
    return batch_object(session, get_batch(session, batch_id, project))


@router.post(
    "/{batch_id}/cancel", response_model=schemas.Batch, responses=schemas.error_responses(409)
)
def cancel(
    batch_id: str, state: StateDep, session: SessionDep, project: ProjectDep
) -> schemas.Batch:
    batch = get_batch(session, batch_id, project)
    if batch.status in ("failed", "completed", "expired"):
        raise APIError(
            409,
            f"batch {batch_id!r} is {batch.status} and cannot be cancelled",
            code="batch_not_cancellable",
        )
    tr.cancel(session, batch_id, state.settings.heartbeat_timeout)
    session.flush()
    return batch_object(session, batch)


@router.get("/{batch_id}/results")
def results(
    batch_id: str,
    state: StateDep,
    session: SessionDep,
    project: ProjectDep,
    after: Annotated[
        str | None, Query(description="the `id` of the last line already read")
    ] = None,
    limit: Annotated[int | None, Query(ge=1)] = None,
) -> StreamingResponse:
    """Extension: the result and error lines finished so far, in the order they finished.

    Pass the `id` of the last line you read as `after` to get only newer ones.
    """
    get_batch(session, batch_id, project)
    after_seq = 0
    if after:
        seq = session.execute(
            select(ResultRow.seq).where(ResultRow.batch_id == batch_id, ResultRow.line_id == after)
        ).scalar_one_or_none()
        if seq is None:
            raise APIError(400, f"no result line {after!r} in batch {batch_id!r}", param="after")
        after_seq = seq
    return StreamingResponse(
        result_lines(state, batch_id, None, after_seq, limit), media_type="application/jsonl"
    )
