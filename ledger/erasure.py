"""What deleting a file erases from the ledger besides the file's row: an output or error file
is a view of its batch's results, and a batch keeps its own copy of each input line."""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow, RequestRow, ResultRow
from conveyor.ledger.states import TERMINAL


def erase_results(session: Session, batch_id: str, ok: bool) -> None:
    """The batch's result lines (`ok`) or error lines (not `ok`): what its output or error
    file holds, and what `/results` would still show."""
    session.execute(
        delete(ResultRow)
        .where(ResultRow.batch_id == batch_id, ResultRow.ok.is_(ok))
        .execution_options(synchronize_session=False)
    )


def erase_input_copies(session: Session, file_id: str) -> None:
    """The copies of the file's lines kept by the finished batches made from it; a batch still
    running keeps its copies, which its workers read."""
    finished = select(BatchRow.id).where(
        BatchRow.input_file_id == file_id, BatchRow.status.in_(TERMINAL)
    )
    session.execute(
        update(RequestRow)
        .where(RequestRow.batch_id.in_(finished))
        .values(raw="")
        .execution_options(synchronize_session=False)
    )
