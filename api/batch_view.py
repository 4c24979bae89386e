"""The batch object of OpenAI's Batch API (with our extensions) as the API reads it: the status
poll, the list, and what create and cancel answer."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, bindparam, inspect, select
from sqlalchemy.orm import Session

from conveyor.api import schemas
from conveyor.api.errors import not_found
from conveyor.api.pagination import keyset_page
from conveyor.ledger.batch_runs import runs_of
from conveyor.ledger.models import BatchRow
from conveyor.ledger.results import counts
from conveyor.ledger.states import TERMINAL, BatchStatus

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
    return batch_object(batch, runs_of(session, [batch_id])[batch_id])


def batch_list(
    session: Session,
    project: str,
    after: str | None,
    limit: int,
    idempotency_key: str | None,
    statuses: Sequence[BatchStatus] = (),
    model: str | None = None,
) -> schemas.BatchList:
    """A page of the project's batches, newest first, after the batch `after`; only those in
    one of `statuses` and of `model` when given."""
    query = _BATCH_FIELDS.where(BatchRow.project == project)
    if idempotency_key is not None:
        query = query.where(BatchRow.idempotency_key == idempotency_key)
    if statuses:
        query = query.where(BatchRow.status.in_(statuses))
    if model is not None:
        query = query.where(BatchRow.model == model)
    rows = keyset_page(session, query, BatchRow, project, after, limit).all()
    runs = runs_of(session, [row.id for row in rows])
    return schemas.list_page(
        schemas.BatchList, rows, limit, lambda row: batch_object(row, runs[row.id])
    )


def batch_object(batch: BatchRow | Row[Any], runs: Sequence[dict[str, Any]] = ()) -> schemas.Batch:
    totals = counts(batch)
    total = batch.total
    progress = 1.0 if batch.status in TERMINAL else (totals.done / total if total else 0.0)
    eta = None
    if (
        batch.status == BatchStatus.IN_PROGRESS
        and batch.first_result_at
        and 0 < totals.done < total
    ):
        elapsed = max(time.time() - batch.first_result_at, 1e-3)
        eta = round((total - totals.done) * elapsed / totals.done, 1)
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
            total=total, completed=totals.completed, failed=totals.failed, reused=totals.reused
        ),
        metadata=batch.metadata_,
        usage=schemas.Usage(
            input_tokens=totals.prompt_tokens,
            input_tokens_details=schemas.InputTokensDetails(cached_tokens=totals.cached_tokens),
            output_tokens=totals.completion_tokens,
            total_tokens=totals.prompt_tokens + totals.completion_tokens,
        ),
        model=batch.model,
        progress=round(progress, 4),
        eta_seconds=eta,
        cached_tokens=totals.cached_tokens,
        status_details=_status_details(batch),
        reproducibility=run_records(runs),
    )


def run_records(runs: Sequence[dict[str, Any]]) -> list[schemas.BatchRun]:
    """A batch's runs (`ledger.batch_runs.runs_of`) as the API shows them."""
    return [schemas.BatchRun.model_validate(run) for run in runs]


def provenance_headers(batch_id: str, runs: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The response headers that name what produced a download of a batch's lines: the batch,
    and the model fingerprints of its runs, first first (none when no run was recorded)."""
    headers = {"Conveyor-Batch-Id": batch_id}
    fingerprints = dict.fromkeys(run["fingerprint"] for run in runs)
    if fingerprints:
        headers["Conveyor-Fingerprints"] = ",".join(fingerprints)
    return headers


def _status_details(batch: BatchRow | Row[Any]) -> str | None:
    if batch.status != BatchStatus.IN_PROGRESS or batch.unserved_since is None:
        return None
    waited = int(time.time() - batch.unserved_since)
    return (
        f"no live worker serves model {batch.model!r} (for {waited}s); the batch fails with "
        "model_not_found once it has waited CONVEYOR_UNSERVED_TIMEOUT: start a worker with this "
        "model or served model name"
    )
