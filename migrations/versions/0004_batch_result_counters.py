"""running result counters on batches

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COUNTERS = {
    "completed_count": (sa.Integer(), "count(*) FILTER (WHERE r.ok)"),
    "failed_count": (sa.Integer(), "count(*) FILTER (WHERE NOT r.ok)"),
    "prompt_tokens": (sa.BigInteger(), "coalesce(sum(r.prompt_tokens), 0)"),
    "completion_tokens": (sa.BigInteger(), "coalesce(sum(r.completion_tokens), 0)"),
    "cached_tokens": (sa.BigInteger(), "coalesce(sum(r.cached_tokens), 0)"),
}


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        for name, (kind, _) in COUNTERS.items():
            batch_op.add_column(sa.Column(name, kind, nullable=False, server_default="0"))
    # batches made before this revision: count what they have
    for name, (_, aggregate) in COUNTERS.items():
        op.execute(
            f"UPDATE batches SET {name} = "
            f"(SELECT {aggregate} FROM results r WHERE r.batch_id = batches.id)"
        )


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        for name in COUNTERS:
            batch_op.drop_column(name)
