"""What ids and text parameters may hold: only what the ledger can store and compare. PostgreSQL
text holds no NUL, UTF-8 no lone surrogate (JSON escapes can make one), and a value longer than
its column can match nothing. A path id that breaks this cannot exist (a 404, from
`api.guard.KeyedRoute`); a query, header, form or body parameter that does is a 400 naming it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, StringConstraints

from ledger.models import BatchRow, FileRow, ResultRow

ID_CHARS = FileRow.__table__.c.id.type.length
assert ID_CHARS == BatchRow.__table__.c.id.type.length == ResultRow.__table__.c.line_id.type.length
IDEMPOTENCY_KEY_CHARS = BatchRow.__table__.c.idempotency_key.type.length
PURPOSE_CHARS = FileRow.__table__.c.purpose.type.length


def unstorable(value: str, max_chars: int | None = None) -> str | None:
    """Why the ledger cannot hold `value` (in a column of `max_chars`), if it cannot."""
    if max_chars is not None and len(value) > max_chars:
        return f"is longer than {max_chars} characters"
    if "\x00" in value:
        return "must not contain NUL characters"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "must not contain lone surrogates (it is not valid Unicode)"
    return None


def _storable(value: str) -> str:
    if problem := unstorable(value):
        raise ValueError(problem)
    return value


Storable = AfterValidator(_storable)
"""In `Annotated[str, ...]`: a text the ledger can store, else a 400 naming the parameter."""

IdText = Annotated[str, StringConstraints(max_length=ID_CHARS), Storable]
"""An id given as a parameter (`after`, `input_file_id`)."""
IdempotencyKey = Annotated[
    str, StringConstraints(min_length=1, max_length=IDEMPOTENCY_KEY_CHARS), Storable
]
PurposeText = Annotated[str, StringConstraints(max_length=PURPOSE_CHARS), Storable]
