"""job_metrics: the reward metrics of DPO runs (rewards/chosen, ..., valid_rewards/margin)

Revision ID: 0206_preference_metrics
Revises: 0205_ui_revoked_sessions
Create Date: 2026-12-01 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0206_preference_metrics"
down_revision = "0205_ui_revoked_sessions"
branch_labels = None
depends_on = None

COLUMNS = tuple(
    f"{prefix}rewards_{name}"
    for prefix in ("", "valid_")
    for name in ("chosen", "rejected", "accuracy", "margin")
)


def upgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
