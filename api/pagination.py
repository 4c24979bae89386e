"""Keyset pagination of the list routes: rows in creation order, after the row a client last
saw (`after`), one more than the page so the page knows whether there is more."""

from __future__ import annotations

from sqlalchemy import Result, Select, select, tuple_
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow, FileRow


def keyset_page(
    session: Session,
    query: Select,
    table: type[BatchRow] | type[FileRow],
    project: str,
    after: str | None,
    limit: int,
    descending: bool = True,
) -> Result:
    """`query` (over `table`) from after the project's row `after`, ordered by (created_at,
    id), newest first when `descending`, at most `limit + 1` rows. An `after` that names no
    row of the project starts from the beginning."""
    keys = (table.created_at, table.id)
    if after:
        cursor = session.execute(
            select(*keys).where(table.id == after, table.project == project)
        ).first()
        if cursor is not None:
            later = (
                tuple_(*keys) < tuple_(*cursor) if descending else tuple_(*keys) > tuple_(*cursor)
            )
            query = query.where(later)
    order = [key.desc() for key in keys] if descending else list(keys)
    return session.execute(query.order_by(*order).limit(limit + 1))
