"""fleet state the scheduler publishes: jobs.queue_position, pool_capacity

Revision ID: 0202_fleet_state
Revises: 0201_job_list_versions
Create Date: 2026-11-29 20:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0202_fleet_state"
down_revision = "0201_job_list_versions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("queue_position", sa.Integer(), nullable=True))
    op.create_table(
        "pool_capacity",
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("observed_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("pool", name=op.f("pk_pool_capacity")),
    )


def downgrade() -> None:
    op.drop_table("pool_capacity")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue_position")
