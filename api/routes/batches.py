"""`/v1/batches`: create, list, retrieve and cancel batches; stream partial results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from conveyor.api import batch_summary, schemas
from conveyor.api.batch_create import create_batch
from conveyor.api.batch_view import batch_list, batch_object, read_batch
from conveyor.api.deps import ProjectDep, SessionDep, StateDep, read_in_session
from conveyor.api.errors import APIError
from conveyor.api.guard import KeyedRoute
from conveyor.api.lookups import get_batch
from conveyor.api.params import IdempotencyKey, IdText, ModelText
from conveyor.api.results import result_lines, seq_after
from conveyor.ledger import batch_lifecycle
from conveyor.ledger.states import BatchStatus
from conveyor.wire_format.errors import BATCH_NOT_CANCELLABLE

router = APIRouter(
    prefix="/v1/batches", tags=["batches"], responses=schemas.V1_ERRORS, route_class=KeyedRoute
)


@router.post("", response_model=schemas.Batch, responses=schemas.error_responses(409, 413, 429))
async def create(
    body: schemas.BatchCreate,
    state: StateDep,
    project: ProjectDep,
    idempotency_key: Annotated[IdempotencyKey | None, Header()] = None,
) -> schemas.Batch:
    """With an `Idempotency-Key` header, a create that repeats a key with the same parameters
    returns the batch first created with it instead of creating another; with other
    parameters it is a 409 naming them."""
    batch_id = await run_in_threadpool(create_batch, state, body, project, idempotency_key)
    return await read_in_session(state, read_batch, batch_id, project)


@router.get("", response_model=schemas.BatchList)
async def list_batches(
    state: StateDep,
    project: ProjectDep,
    after: IdText | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    idempotency_key: IdempotencyKey | None = None,
    status: Annotated[
        list[BatchStatus] | None, Query(description="extension: only batches in these statuses")
    ] = None,
    model: Annotated[
        ModelText | None, Query(description="extension: only batches of this model")
    ] = None,
) -> schemas.BatchList:
    return await read_in_session(
        state, batch_list, project, after, limit, idempotency_key, status or (), model
    )


@router.get("/{batch_id}", response_model=schemas.Batch)
async def retrieve(batch_id: str, state: StateDep, project: ProjectDep) -> schemas.Batch:
    return await read_in_session(state, read_batch, batch_id, project)


@router.post(
    "/{batch_id}/cancel", response_model=schemas.Batch, responses=schemas.error_responses(409)
)
def cancel(
    batch_id: str, state: StateDep, session: SessionDep, project: ProjectDep
) -> schemas.Batch:
    batch = get_batch(session, batch_id, project)
    try:
        batch_lifecycle.cancel(session, batch_id, state.settings.heartbeat_timeout)
    except batch_lifecycle.NotCancellable as err:
        raise APIError(409, str(err), code=BATCH_NOT_CANCELLABLE) from None
    session.flush()
    return batch_object(batch)


@router.get("/{batch_id}/error_groups", response_model=schemas.ErrorGroupList)
async def error_groups(
    batch_id: str,
    state: StateDep,
    project: ProjectDep,
    examples: Annotated[int, Query(ge=0, le=20, description="error lines shown per code")] = 3,
) -> schemas.ErrorGroupList:
    """Extension: the batch's error lines grouped by `error.code`, most frequent first, each
    with its first `examples` lines (`custom_id`, `message`). Read from at most the first
    20,000 error lines (`complete` says whether that was all of them)."""
    return await read_in_session(state, batch_summary.error_groups, batch_id, project, examples)


@router.get("/{batch_id}/diff", response_model=schemas.BatchDiff)
async def diff(
    batch_id: str,
    state: StateDep,
    project: ProjectDep,
    against: Annotated[IdText, Query(description="the batch to compare with (the first run)")],
    top: Annotated[int, Query(ge=0, le=1000, description="score changes listed")] = 10,
    tolerance: Annotated[
        float, Query(ge=0, description="a score that moved by at most this much is the same")
    ] = 0.0,
) -> schemas.BatchDiff:
    """Extension: what this batch answered otherwise than `against`, lines matched by
    `custom_id` (what `conveyor diff` prints): changed, new and gone lines, and the largest
    changes in the summed log-probability of lines with logprobs."""
    return await read_in_session(
        state, batch_summary.batch_diff, batch_id, against, project, top, tolerance
    )


@router.get("/{batch_id}/throughput", response_model=schemas.Throughput)
async def throughput(batch_id: str, state: StateDep, project: ProjectDep) -> schemas.Throughput:
    """Extension: the batch's results and output tokens per interval, from its first result to
    its last (at most about 60 intervals, each `bucket_seconds` long)."""
    return await read_in_session(state, batch_summary.throughput, batch_id, project)


@router.get("/{batch_id}/results")
def results(
    batch_id: str,
    state: StateDep,
    session: SessionDep,
    project: ProjectDep,
    after: Annotated[
        IdText | None, Query(description="the `id` of the last line already read")
    ] = None,
    limit: Annotated[int | None, Query(ge=1)] = None,
) -> StreamingResponse:
    """Extension: the result and error lines finished so far, in the order they finished.

    Pass the `id` of the last line you read as `after` to get only newer ones.
    """
    get_batch(session, batch_id, project)
    after_seq = seq_after(session, batch_id, after)
    return StreamingResponse(
        result_lines(state.ledger, batch_id, None, after_seq, limit),
        media_type="application/jsonl",
    )
