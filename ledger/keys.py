"""API keys: create (the secret is shown once), look up by secret, list, revoke."""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.ledger.models import ApiKeyRow, BatchRow, FileRow

NAME_CHARS = ApiKeyRow.__table__.c.name.type.length
PROJECT_CHARS = ApiKeyRow.__table__.c.project.type.length

KEY_PREFIX = "cvy-"


def key_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_label(what: str, value: str, limit: int) -> str:
    """A key's name or project, stripped; ValueError if empty, too long or not printable."""
    value = value.strip()
    if not value:
        raise ValueError(f"the {what} must not be empty")
    if len(value) > limit:
        raise ValueError(f"the {what} is longer than {limit} characters")
    if not value.isprintable():
        raise ValueError(f"the {what} must hold printable characters only")
    return value


def project_exists(session: Session, project: str) -> bool:
    """Whether `project` owns anything yet: a key (live or revoked), a file or a batch."""
    return any(
        session.execute(select(table.project).where(table.project == project).limit(1)).first()
        for table in (ApiKeyRow, FileRow, BatchRow)
    )


def create_key(session: Session, name: str, project: str) -> tuple[ApiKeyRow, str]:
    """A new key of `project`; returns its row and its secret (not stored anywhere)."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKeyRow(
        id=f"key_{secrets.token_hex(8)}",
        name=name,
        project=project,
        key_hash=key_hash(secret),
        created_at=int(time.time()),
    )
    session.add(row)
    session.flush()
    return row, secret


def find_key(session: Session, secret: str) -> ApiKeyRow | None:
    """The live (not revoked) key with this secret."""
    return session.execute(
        select(ApiKeyRow).where(
            ApiKeyRow.key_hash == key_hash(secret), ApiKeyRow.revoked_at.is_(None)
        )
    ).scalar_one_or_none()


def list_keys(session: Session) -> list[ApiKeyRow]:
    return list(session.execute(select(ApiKeyRow).order_by(ApiKeyRow.created_at)).scalars())


def revoke_key(session: Session, key_id: str) -> ApiKeyRow | None:
    row = session.get(ApiKeyRow, key_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = int(time.time())
    return row
