"""ix_results_reuse on (request_key, fingerprint): the key, nearly unique, first

On (fingerprint, request_key), PostgreSQL without statistics on a freshly filled table (and
with them, for a long list of keys) scanned the index by fingerprint alone and filtered every
result of the fingerprint by key: a lookup of 500 keys among 100,000 results took 35 ms
instead of 6 (bench/reuse_lookup.py). With the key first, the index is used by key or not at
all.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_index("ix_results_reuse")
        batch_op.create_index("ix_results_reuse", ["request_key", "fingerprint"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_index("ix_results_reuse")
        batch_op.create_index("ix_results_reuse", ["fingerprint", "request_key"], unique=False)
