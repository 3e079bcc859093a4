"""Trainer report bounds and merged exports

jobs.report_items / report_bytes / report_items_dropped count the metric and event items
a job's trainer stored (and those dropped past the job's quota); report_batches.applied_items
is how many items of a batch are applied, so a batch written in several transactions
resumes where it stopped. Batches applied before this revision were applied whole.
exports: one row per merged export (its adapter, dtype and status), so an adapter is
merged once at a time, a tenant's exports are capped, and a finished export is reused.

Revision ID: 0213_reports_and_exports
Revises: 0211_restart_backoff
Create Date: 2026-12-06 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0213_reports_and_exports"
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
    op.create_table(
        "exports",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_exports_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_exports_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exports")),
    )
    op.create_index("ix_exports_job", "exports", ["job_id", "checkpoint_id"], unique=False)
    op.create_index("ix_exports_tenant_status", "exports", ["tenant_id", "status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_exports_tenant_status", table_name="exports")
    op.drop_index("ix_exports_job", table_name="exports")
    op.drop_table("exports")
    with op.batch_alter_table("report_batches") as batch:
        batch.drop_column("applied_items")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("report_items_dropped")
        batch.drop_column("report_bytes")
        batch.drop_column("report_items")
