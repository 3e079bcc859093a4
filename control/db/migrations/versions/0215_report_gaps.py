"""jobs.report_gaps: what a job's records lack that its trainer's outputs could not supply

Revision ID: 0215_report_gaps
Revises: 0214_uploads_permissions
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0215_report_gaps"
down_revision = "0214_uploads_permissions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("report_gaps", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("report_gaps")
