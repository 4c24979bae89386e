"""Whether a running batch's model has a live worker: kept on the batch, so that a status poll,
`/readyz` and the metrics can say why a batch waits without looking at the workers."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow
from conveyor.ledger.states import BatchStatus


def note_serving(session: Session, is_served: Callable[[str], bool]) -> None:
    """Mark each in-progress batch whose model `is_served` says no live worker serves since
    now (keeping an earlier mark), and clear the mark of those whose model is served again."""
    rows = session.execute(
        select(BatchRow.id, BatchRow.model, BatchRow.unserved_since).where(
            BatchRow.status == BatchStatus.IN_PROGRESS
        )
    ).all()
    served = {model: is_served(model) for model in {row.model or "" for row in rows}}
    unserved = [r.id for r in rows if r.unserved_since is None and not served[r.model or ""]]
    back = [r.id for r in rows if r.unserved_since is not None and served[r.model or ""]]
    if unserved:
        session.execute(
            update(BatchRow).where(BatchRow.id.in_(unserved)).values(unserved_since=time.time())
        )
    if back:
        session.execute(update(BatchRow).where(BatchRow.id.in_(back)).values(unserved_since=None))


def unserved_models(session: Session) -> Counter[str]:
    """Model -> in-progress batches waiting for a worker that serves it."""
    rows = session.execute(
        select(BatchRow.model).where(
            BatchRow.status == BatchStatus.IN_PROGRESS, BatchRow.unserved_since.is_not(None)
        )
    ).scalars()
    return Counter(model or "" for model in rows)


def unserved_for(session: Session, seconds: float) -> list[str]:
    """The in-progress batches whose model no live worker has served for `seconds`."""
    return list(
        session.execute(
            select(BatchRow.id).where(
                BatchRow.status == BatchStatus.IN_PROGRESS,
                BatchRow.unserved_since <= time.time() - seconds,
            )
        ).scalars()
    )


def note_new_batch(batch: BatchRow, served: bool) -> None:
    """A batch just opened is noted at once, not at the next reconcile, when no live worker
    serves its model."""
    if not served and batch.status == BatchStatus.IN_PROGRESS:
        batch.unserved_since = time.time()
