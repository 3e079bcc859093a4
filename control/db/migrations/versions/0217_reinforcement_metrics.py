"""job_metrics: the metrics of reinforcement runs (reward_mean, ..., valid_reward_mean)

Revision ID: 0217_reinforcement_metrics
Revises: 0216_job_throughput
Create Date: 2026-12-08 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0217_reinforcement_metrics"
down_revision = "0216_job_throughput"
branch_labels = None
depends_on = None

COLUMNS = ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length", "valid_reward_mean")


def upgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
