"""The rows a request names, as its project may see them: another project's ids do not exist
for it (404), nor do deleted files."""

from __future__ import annotations

from sqlalchemy.orm import Session

from conveyor.api.errors import not_found
from conveyor.ledger.models import BatchRow, FileRow


def get_file(session: Session, file_id: str, project: str) -> FileRow:
    file = session.get(FileRow, file_id)
    if file is None or file.deleted or file.project != project:
        raise not_found("file", file_id)
    return file


def get_batch(session: Session, batch_id: str, project: str) -> BatchRow:
    batch = session.get(BatchRow, batch_id)
    if batch is None or batch.project != project:
        raise not_found("batch", batch_id)
    return batch
