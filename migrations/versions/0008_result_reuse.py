"""exact reuse: results.fingerprint, request_key, reused; batches.reuse, reused_count

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("fingerprint", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("request_key", sa.String(length=64), nullable=True))
        batch_op.add_column(
            sa.Column("reused", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.create_index("ix_results_reuse", ["fingerprint", "request_key"], unique=False)
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("reused_count", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("reuse", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("reuse")
        batch_op.drop_column("reused_count")
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_index("ix_results_reuse")
        batch_op.drop_column("reused")
        batch_op.drop_column("request_key")
        batch_op.drop_column("fingerprint")
