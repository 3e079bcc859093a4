"""job_metrics.mfu and jobs.mean_tokens_per_s / mean_mfu: the throughput users see

Revision ID: 0216_job_throughput
Revises: 0215_report_gaps
Create Date: 2026-12-08 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0216_job_throughput"
down_revision = "0215_report_gaps"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        batch.add_column(sa.Column("mfu", sa.Float(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("mean_tokens_per_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("mean_mfu", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("mean_mfu")
        batch.drop_column("mean_tokens_per_s")
    with op.batch_alter_table("job_metrics") as batch:
        batch.drop_column("mfu")
