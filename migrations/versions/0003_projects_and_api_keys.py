"""API keys; files and batches belong to a project

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("revoked_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    for table in ("files", "batches"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column(
                    "project", sa.String(length=128), nullable=False, server_default="default"
                )
            )
            batch_op.create_index(f"ix_{table}_project", ["project"], unique=False)
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_constraint("uq_batches_idempotency_key", type_="unique")
        batch_op.create_unique_constraint(
            "uq_batches_project_idempotency_key", ["project", "idempotency_key"]
        )


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_constraint("uq_batches_project_idempotency_key", type_="unique")
        batch_op.create_unique_constraint("uq_batches_idempotency_key", ["idempotency_key"])
    for table in ("files", "batches"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(f"ix_{table}_project")
            batch_op.drop_column("project")
    op.drop_table("api_keys")
