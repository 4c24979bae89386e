"""Exact reuse of earlier results: a line of a batch created with `reuse: "exact"` is answered
from an earlier completed line of the same project whose model fingerprint and normalised
request key are the same (`request_outcome.reuse_key`); only deterministic lines have a key.

A build system's cache, for evaluations: the key is exact, a hit says where it came from
(`reused_from`), and deleting a batch (or a file that held its lines) deletes its results, so
nothing deleted is ever served again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow, ResultRow

REUSE_EXACT = "exact"  # the one reuse mode: the same fingerprint and request key
REUSE_MODES = (REUSE_EXACT,)
LOOKUP_CHUNK = 500  # keys per query


@dataclass
class Reusable:
    output: str  # the earlier result line, as JSON text
    batch_id: str
    line_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


# The results of the keys, through the index on (request_key, fingerprint) alone; the project
# of their batches is checked after, by the batches' primary key, and the earliest result of a
# key picked here. Each of those, left to the database, gave its planner a way to read every
# result for each lookup: joined to the batches, PostgreSQL without statistics on a freshly
# filled table drove the query from the project's batches (45 ms instead of 1 ms for 32 keys
# among 100,000 results), and SQLite did as soon as the key came first in the index (a minute
# and more for 100,000 keys; bench/reuse_lookup.py); ordered by `seq`, PostgreSQL may walk the
# primary key in order and filter every row. Only the picked results' lines are read: a key
# reused every night has a result per night, and all but the first would be read for nothing.
_FIND = select(ResultRow.seq, ResultRow.request_key, ResultRow.batch_id).where(
    ResultRow.request_key.in_(bindparam("keys", expanding=True)),
    ResultRow.fingerprint == bindparam("fingerprint"),
    ResultRow.ok.is_(True),
)
_OWNED = select(BatchRow.id).where(
    BatchRow.id.in_(bindparam("batch_ids", expanding=True)),
    BatchRow.project == bindparam("project"),
)
_READ = select(
    ResultRow.request_key,
    ResultRow.output,
    ResultRow.batch_id,
    ResultRow.line_id,
    ResultRow.prompt_tokens,
    ResultRow.completion_tokens,
    ResultRow.cached_tokens,
).where(ResultRow.seq.in_(bindparam("seqs", expanding=True)))


def find_reusable(
    session: Session, project: str, fingerprint: str, keys: Iterable[str]
) -> dict[str, Reusable]:
    """The earliest reusable result of each key that has one, in `project` under
    `fingerprint`."""
    wanted = sorted(set(keys))
    found: dict[str, Reusable] = {}
    owned: dict[str, bool] = {}  # batch id: whether it is the project's
    for start in range(0, len(wanted), LOOKUP_CHUNK):
        params = {"fingerprint": fingerprint, "keys": wanted[start : start + LOOKUP_CHUNK]}
        rows = session.execute(_FIND, params).all()
        unseen = sorted({row.batch_id for row in rows} - owned.keys())
        if unseen:
            mine = set(session.scalars(_OWNED, {"batch_ids": unseen, "project": project}))
            owned.update((batch_id, batch_id in mine) for batch_id in unseen)
        earliest: dict[str, int] = {}
        for seq, key, batch_id in sorted(rows):  # by seq: the earliest first
            if owned[batch_id]:
                earliest.setdefault(key, seq)
        if earliest:
            for key, *rest in session.execute(_READ, {"seqs": sorted(earliest.values())}):
                found[key] = Reusable(*rest)
    return found


def lookup_plan(session: Session, fingerprint: str, keys: list[str]) -> str:
    """The database's plan of the lookup of `keys` (at most `LOOKUP_CHUNK`), one line per
    step: PostgreSQL's EXPLAIN, SQLite's EXPLAIN QUERY PLAN. Whether it names
    `models.REUSE_INDEX` says whether a lookup goes through the index or reads the whole
    table."""
    connection = session.connection()
    query = _FIND.params(fingerprint=fingerprint, keys=keys)
    sql = query.compile(dialect=connection.dialect, compile_kwargs={"literal_binds": True})
    explain = "EXPLAIN QUERY PLAN" if connection.dialect.name == "sqlite" else "EXPLAIN"
    rows = connection.exec_driver_sql(f"{explain} {sql}").all()
    return "\n".join(str(row[-1]) for row in rows)
