"""Trainer report bounds: each job's stored report items and bytes, each batch's progress

jobs.report_items / report_bytes / report_items_dropped count the metric and event items
a job's trainer stored (and those dropped past the job's quota); report_batches.applied_items
is how many items of a batch are applied, so a batch written in several transactions
resumes where it stopped. Batches applied before this revision were applied whole.

Revision ID: 0213_report_quotas
Revises: 0211_restart_backoff
Create Date: 2026-12-06 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0213_report_quotas"
down_revision = "0211_restart_backoff"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("report_items", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("report_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("report_items_dropped", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("report_batches") as batch:
        batch.add_column(sa.Column("applied_items", sa.Integer(), nullable=False, server_default="0"))
    op.execute("UPDATE report_batches SET applied_items = n_items")


def downgrade() -> None:
    with op.batch_alter_table("report_batches") as batch:
        batch.drop_column("applied_items")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("report_items_dropped")
        batch.drop_column("report_bytes")
        batch.drop_column("report_items")
