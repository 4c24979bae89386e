"""What ids and text parameters may hold: only what the ledger can store and compare. PostgreSQL
text holds no NUL, UTF-8 no lone surrogate (JSON escapes can make one), and a value longer than
its column can match nothing. A path id that breaks this cannot exist (a 404, from
`api.guard.KeyedRoute`); a query, header, form or body parameter that does is a 400 naming it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, StringConstraints

from conveyor.ledger.models import BatchRow, FileRow, ResultRow
from conveyor.wire_format.text import unstorable

ID_CHARS = FileRow.__table__.c.id.type.length
assert ID_CHARS == BatchRow.__table__.c.id.type.length == ResultRow.__table__.c.line_id.type.length
IDEMPOTENCY_KEY_CHARS = BatchRow.__table__.c.idempotency_key.type.length
PURPOSE_CHARS = FileRow.__table__.c.purpose.type.length
MODEL_CHARS = BatchRow.__table__.c.model.type.length


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
ModelText = Annotated[str, StringConstraints(max_length=MODEL_CHARS), Storable]
"""A model name given as a parameter (`model` of the batch list)."""
