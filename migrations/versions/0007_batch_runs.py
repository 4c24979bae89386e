"""batch_runs: what ran each batch (worker, model fingerprint, engine settings)

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_runs",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("first_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "worker", "fingerprint"),
    )


def downgrade() -> None:
    op.drop_table("batch_runs")
