"""jobs.retry_placement: the larger gang a job gets after running out of GPU memory

Revision ID: 0203_retry_placement
Revises: 0202_fleet_state
Create Date: 2026-11-30 04:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0203_retry_placement"
down_revision = "0202_fleet_state"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("retry_placement", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("retry_placement")
