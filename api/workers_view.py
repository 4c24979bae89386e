"""The live workers and each model's queue, as the ledger knows them: a worker's row and the
engine stats its heartbeat writes there, and the shards waiting or running per model."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from conveyor.api import schemas
from conveyor.ledger.models import BatchRow, ShardRow, WorkerRow
from conveyor.ledger.states import BatchStatus, ShardStatus
from conveyor.ledger.workers import live_worker_rows
from conveyor.served_names import listed_names


def worker_list(session: Session, heartbeat_timeout: float) -> schemas.WorkerList:
    """Every worker seen within `heartbeat_timeout`, with its engine's state."""
    shards = dict(
        session.execute(
            select(ShardRow.worker, func.count())
            .where(ShardRow.status == ShardStatus.RUNNING)
            .group_by(ShardRow.worker)
        ).all()
    )
    return schemas.WorkerList(
        data=[
            _worker(row, shards.get(row.id, 0))
            for row in live_worker_rows(session, heartbeat_timeout)
        ]
    )


def _number(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get(key)  # a worker of an older version, or the echo engine, may lack it
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(stats: dict[str, Any], key: str) -> int | None:
    value = _number(stats, key)
    return None if value is None else int(value)


def _ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def _worker(row: WorkerRow, running_shards: int) -> schemas.Worker:
    stats = row.stats or {}
    computed = _number(stats, "prompt_tokens_computed")
    cached = _number(stats, "prompt_tokens_cached")
    prompt = None if computed is None or cached is None else computed + cached
    device = stats.get("device")
    return schemas.Worker(
        id=row.id,
        models=listed_names(row.models),
        device=device if isinstance(device, str) else None,
        started_at=int(row.started_at),
        last_seen=row.last_seen,
        running_requests=_count(stats, "num_running"),
        waiting_requests=_count(stats, "num_waiting"),
        in_flight_requests=_count(stats, "in_flight"),
        kv_cache_usage=_ratio(_number(stats, "kv_blocks_used"), _number(stats, "kv_blocks_total")),
        kv_bytes_per_token=_count(stats, "kv_bytes_per_token") or None,
        prefix_cache_hit_rate=_ratio(cached, prompt),
        generation_tokens=_count(stats, "generation_tokens"),
        preemptions=_count(stats, "num_preemptions"),
        running_shards=running_shards,
        plan=_plan(stats.get("plan")),
        fingerprint=fingerprint(stats),
        default_sampling=default_sampling(stats),
    )


def fingerprint(stats: dict[str, Any] | None) -> str | None:
    value = (stats or {}).get("fingerprint")
    return value if isinstance(value, str) else None


def default_sampling(stats: dict[str, Any] | None) -> dict[str, int | float]:
    """The sampling a worker's requests get for what they leave out, as its heartbeat wrote it
    (a worker of another version may have written none, or something else)."""
    value = (stats or {}).get("default_sampling")
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if _number(value, k) is not None}


def _plan(value: object) -> schemas.EnginePlan | None:
    try:
        return schemas.EnginePlan.model_validate(value) if isinstance(value, dict) else None
    except ValueError:  # a worker of another version: leave it out
        return None


def model_queues(session: Session, project: str, heartbeat_timeout: float) -> schemas.QueueList:
    """Per model that live workers serve or the project's work waits for: its live workers,
    and the project's queued and running shards and batches in progress."""
    workers = Counter(m for row in live_worker_rows(session, heartbeat_timeout) for m in row.models)
    shards = session.execute(
        select(BatchRow.model, ShardRow.status, func.count(), func.sum(ShardRow.size))
        .join(BatchRow, BatchRow.id == ShardRow.batch_id)
        .where(
            BatchRow.project == project,
            ShardRow.status.in_((ShardStatus.QUEUED, ShardStatus.RUNNING)),
        )
        .group_by(BatchRow.model, ShardRow.status)
    ).all()
    batches: Counter[str] = Counter()
    for model, n in session.execute(
        select(BatchRow.model, func.count())
        .where(BatchRow.project == project, BatchRow.status == BatchStatus.IN_PROGRESS)
        .group_by(BatchRow.model)
    ):
        batches[model or ""] += n
    models = set(workers) | set(batches) | {model or "" for model, *_ in shards}
    queues = {
        model: schemas.ModelQueue(
            model=model,
            workers=workers[model],
            queued_requests=0,
            queued_shards=0,
            running_shards=0,
            batches_in_progress=batches[model],
        )
        for model in sorted(models)
    }
    for model, status, n, requests in shards:
        queue = queues[model or ""]
        if status == ShardStatus.QUEUED:
            queue.queued_shards += n
            queue.queued_requests += int(requests)
        else:
            queue.running_shards += n
    return schemas.QueueList(data=list(queues.values()))
