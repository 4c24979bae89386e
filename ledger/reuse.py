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


_FIND = (
    select(
        ResultRow.request_key,
        ResultRow.output,
        ResultRow.batch_id,
        ResultRow.line_id,
        ResultRow.prompt_tokens,
        ResultRow.completion_tokens,
        ResultRow.cached_tokens,
    )
    .join(BatchRow, BatchRow.id == ResultRow.batch_id)
    .where(
        ResultRow.fingerprint == bindparam("fingerprint"),
        ResultRow.request_key.in_(bindparam("keys", expanding=True)),
        ResultRow.ok.is_(True),
        BatchRow.project == bindparam("project"),
    )
    .order_by(ResultRow.seq)
)


def find_reusable(
    session: Session, project: str, fingerprint: str, keys: Iterable[str]
) -> dict[str, Reusable]:
    """The earliest reusable result of each key that has one, in `project` under
    `fingerprint`."""
    wanted = sorted(set(keys))
    found: dict[str, Reusable] = {}
    for start in range(0, len(wanted), LOOKUP_CHUNK):
        params = {"fingerprint": fingerprint, "project": project,
                  "keys": wanted[start : start + LOOKUP_CHUNK]}  # fmt: skip
        for key, *rest in session.execute(_FIND, params):
            found.setdefault(key, Reusable(*rest))
    return found
