"""The worker registry, in the ledger: which workers there are, which are alive, what they
serve. A worker writes its row when it starts and with every heartbeat (`announce`), and marks
it not seen when it stops (`withdraw`); the row stays, so that its models are known to have
been served (an online request for one is then a 503 to retry, not a 404). Everyone else asks
here who is alive: a worker seen within the heartbeat timeout."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.ledger.models import WorkerRow

WITHDRAWN = 0.0  # the last_seen of a worker that stopped announcing itself


def announce(
    session: Session,
    name: str,
    models: list[str],
    queues: list[str],
    started_at: float,
    stats: dict[str, Any],
) -> None:
    """Write (or refresh) a worker's row: it is alive now."""
    session.merge(
        WorkerRow(
            id=name,
            models=models,
            queues=queues,
            started_at=started_at,
            last_seen=time.time(),
            stats=stats,
        )  # fmt: skip
    )


def withdraw(session: Session, name: str) -> None:
    session.execute(update(WorkerRow).where(WorkerRow.id == name).values(last_seen=WITHDRAWN))


def live_worker_rows(session: Session, heartbeat_timeout: float) -> list[WorkerRow]:
    """The workers seen within `heartbeat_timeout`, by name."""
    cutoff = time.time() - heartbeat_timeout
    query = select(WorkerRow).where(WorkerRow.last_seen >= cutoff).order_by(WorkerRow.id)
    return list(session.execute(query).scalars())


def workers_by_queue(session: Session, heartbeat_timeout: float) -> dict[str, list[str]]:
    """Model queue -> names of the live workers that consume it."""
    by_queue: dict[str, list[str]] = defaultdict(list)
    for worker in live_worker_rows(session, heartbeat_timeout):
        for queue in worker.queues:
            by_queue[queue].append(worker.id)
    return dict(by_queue)


def served_models(session: Session, heartbeat_timeout: float) -> tuple[set[str], set[str]]:
    """(models that live workers serve, models that workers gone silent served)."""
    cutoff = time.time() - heartbeat_timeout
    live: set[str] = set()
    known: set[str] = set()
    for models, last_seen in session.execute(select(WorkerRow.models, WorkerRow.last_seen)):
        (live if last_seen >= cutoff else known).update(models)
    return live, known
