"""jobs.attempt and jobs.exited_attempt: every executor outcome names its run attempt

Revision ID: 0204_run_attempts
Revises: 0203_retry_placement
Create Date: 2026-12-01 10:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0204_run_attempts"
down_revision = "0203_retry_placement"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("exited_attempt", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("exited_attempt")
        batch.drop_column("attempt")
