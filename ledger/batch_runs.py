"""What ran each batch, kept in the ledger: the worker, its model fingerprint, its engine's
settings and the sampling defaults in force (`BatchRunRow`), written when a worker first takes
a shard of the batch and read back with the batch object."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRunRow


def record_run(
    session: Session, batch_id: str, worker: str, fingerprint: str, record: dict[str, Any]
) -> None:
    """Note that `worker` ran part of `batch_id` under `fingerprint`; the first note of a
    (batch, worker, fingerprint) stays."""
    key = (batch_id, worker, fingerprint)
    if session.get(BatchRunRow, key) is not None:
        return
    try:
        with session.begin_nested():  # another thread of the worker may have noted it
            session.add(BatchRunRow(batch_id=batch_id, worker=worker, fingerprint=fingerprint,
                                    record=record, first_at=time.time()))  # fmt: skip
    except IntegrityError:
        pass


def runs_of(session: Session, batch_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Each batch's runs, first first: {"worker", "fingerprint", "first_at", **record}."""
    ids = list(batch_ids)
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if not ids:
        return found
    rows = session.execute(
        select(BatchRunRow)
        .where(BatchRunRow.batch_id.in_(ids))
        .order_by(BatchRunRow.first_at, BatchRunRow.worker)
    ).scalars()
    for row in rows:
        found[row.batch_id].append(
            {
                "worker": row.worker,
                "fingerprint": row.fingerprint,
                "first_at": row.first_at,
                **row.record,
            }  # fmt: skip
        )
    return found
