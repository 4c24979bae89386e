"""A batch's result and error lines as the API streams them: in commit order, page by page,
never all at once (a file's content, and `/v1/batches/{id}/results`)."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.api.errors import APIError
from conveyor.ledger.db import Ledger
from conveyor.ledger.models import ResultRow
from conveyor.wire_format.result_lines import one_line

PAGE = 1000


def result_lines(
    ledger: Ledger, batch_id: str, ok: bool | None, after_seq: int = 0, limit: int | None = None
) -> Iterator[bytes]:
    """The batch's lines after `after_seq` (results only with `ok`, errors only with `not
    ok`, both with None), at most `limit`."""
    sent = 0
    while limit is None or sent < limit:
        page = PAGE if limit is None else min(PAGE, limit - sent)
        with ledger.session() as session:
            query = select(ResultRow.seq, ResultRow.output).where(
                ResultRow.batch_id == batch_id, ResultRow.seq > after_seq
            )
            if ok is not None:
                query = query.where(ResultRow.ok.is_(ok))
            rows = session.execute(query.order_by(ResultRow.seq).limit(page)).all()
        if not rows:
            return
        after_seq = rows[-1][0]
        sent += len(rows)
        # one_line: lines written before the line ends in their strings were escaped
        yield "".join(one_line(output) + "\n" for _, output in rows).encode()
        if len(rows) < page:
            return


def seq_after(session: Session, batch_id: str, line_id: str | None) -> int:
    """Where the lines after the batch's line `line_id` start (0: from the first); 400 for a
    line the batch does not have."""
    if not line_id:
        return 0
    seq = session.execute(
        select(ResultRow.seq).where(ResultRow.batch_id == batch_id, ResultRow.line_id == line_id)
    ).scalar_one_or_none()
    if seq is None:
        raise APIError(400, f"no result line {line_id!r} in batch {batch_id!r}", param="after")
    return seq
