"""Locks that serialize transactions which read and then write on what they read."""

from __future__ import annotations

import hashlib

from sqlalchemy import false, text, update
from sqlalchemy.orm import Session

from conveyor.ledger.models import BatchRow


def lock_project_batches(session: Session, project: str) -> None:
    """Hold, until this transaction ends, the right to add batches to `project`: another
    transaction that asks waits here, so a count of the project's batches read after this
    call stays true until the insert it allows has committed."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(project)})
    else:
        # SQLite has one writer at a time: a write, even of nothing, makes this transaction
        # that writer now (waiting for the busy timeout), before it reads the count
        session.execute(update(BatchRow).where(false()).values(project=BatchRow.project))


def _lock_key(project: str) -> int:
    """A signed 64-bit advisory lock key for the project's batch creation."""
    digest = hashlib.blake2b(f"conveyor:batches:{project}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
