"""What a batch's result lines add up to, for the people watching it: its error lines grouped by
code, and its results over time. Both read the ledger's `results` rows of one batch."""

from __future__ import annotations

import json
import math

from sqlalchemy import BigInteger, bindparam, case, cast, func, select
from sqlalchemy.orm import Session

from conveyor.api import schemas
from conveyor.api.lookups import get_batch
from conveyor.ledger.batch_runs import runs_of
from conveyor.ledger.models import ResultRow
from conveyor.wire_format.result_diff import diff_runs

# error lines read to group them: enough for any batch's picture, bounded for one of 50,000
MAX_SCANNED = 20_000
# interval lengths (seconds) a throughput series may use; the shortest giving at most
# MAX_POINTS intervals is taken
BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
MAX_POINTS = 60


def batch_diff(
    session: Session, batch_id: str, against: str, project: str, top: int, tolerance: float
) -> schemas.BatchDiff:
    """What `batch_id` answered otherwise than `against` (its first run), line by line
    (`wire_format.result_diff`)."""
    for one in (batch_id, against):
        get_batch(session, one, project)
    runs = runs_of(session, [against, batch_id])
    found = diff_runs(
        _lines(session, against), _lines(session, batch_id), tolerance, runs[against],
        runs[batch_id],
    )  # fmt: skip
    return schemas.BatchDiff(
        batch_id=batch_id, against=against, differs=found.differs, **found.as_dict(top)
    )


def _lines(session: Session, batch_id: str) -> list[dict]:
    outputs = session.execute(
        select(ResultRow.output).where(ResultRow.batch_id == batch_id).order_by(ResultRow.seq)
    ).scalars()
    return [json.loads(output) for output in outputs]


def error_groups(
    session: Session, batch_id: str, project: str, examples: int
) -> schemas.ErrorGroupList:
    """The batch's error lines by `error.code`, most frequent first, each group with its first
    `examples` lines (in the order they finished)."""
    get_batch(session, batch_id, project)
    outputs = (
        session.execute(
            select(ResultRow.output)
            .where(ResultRow.batch_id == batch_id, ResultRow.ok.is_(False))
            .order_by(ResultRow.seq)
            .limit(MAX_SCANNED + 1)
        )
        .scalars()
        .all()
    )
    groups: dict[str, schemas.ErrorGroup] = {}
    for output in outputs[:MAX_SCANNED]:
        line = json.loads(output)
        error = line.get("error") or {}
        code = str(error.get("code") or "unknown")
        group = groups.setdefault(code, schemas.ErrorGroup(code=code, count=0, examples=[]))
        group.count += 1
        if len(group.examples) < examples:
            group.examples.append(
                schemas.ErrorExample(
                    id=line.get("id"),
                    custom_id=line.get("custom_id"),
                    message=error.get("message"),
                    param=error.get("param"),
                    line=error.get("line"),
                )
            )
    return schemas.ErrorGroupList(
        data=sorted(groups.values(), key=lambda g: (-g.count, g.code)),
        scanned=min(len(outputs), MAX_SCANNED),
        complete=len(outputs) <= MAX_SCANNED,
    )


# a result's interval: whole milliseconds since the series' start divided by the interval's,
# in integers, which PostgreSQL and SQLite divide alike (no floor() needed)
_INTERVAL = (
    cast(ResultRow.created_at * 1000, BigInteger) - bindparam("start_ms", type_=BigInteger)
) // bindparam("bucket_ms", type_=BigInteger)


def throughput(session: Session, batch_id: str, project: str) -> schemas.Throughput:
    """The batch's results per interval, from its first result to its last."""
    get_batch(session, batch_id, project)
    first, last = session.execute(
        select(func.min(ResultRow.created_at), func.max(ResultRow.created_at)).where(
            ResultRow.batch_id == batch_id
        )
    ).one()
    if first is None:
        return schemas.Throughput(bucket_seconds=BUCKETS[0], data=[])
    start = math.floor(first)
    bucket = next((b for b in BUCKETS if (last - start) / b < MAX_POINTS), BUCKETS[-1])
    interval = _INTERVAL.label("interval")
    rows = session.execute(
        select(
            interval,
            func.count(),
            func.sum(case((ResultRow.ok.is_(False), 1), else_=0)),
            func.coalesce(func.sum(ResultRow.completion_tokens), 0),
        )
        .where(ResultRow.batch_id == batch_id)
        .group_by(interval),
        {"start_ms": start * 1000, "bucket_ms": bucket * 1000},
    ).all()
    found = {int(i): (n, int(failed), int(tokens)) for i, n, failed, tokens in rows}
    return schemas.Throughput(
        bucket_seconds=bucket,
        first_result_at=first,
        last_result_at=last,
        data=[_point(start + i * bucket, *found.get(i, (0, 0, 0))) for i in range(max(found) + 1)],
    )


def _point(start: int, requests: int, failed: int, tokens: int) -> schemas.ThroughputPoint:
    return schemas.ThroughputPoint(
        start=start, requests=requests, failed=failed, output_tokens=tokens
    )
