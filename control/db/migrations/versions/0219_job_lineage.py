"""jobs.base_model and jobs.parent: a job that continues a fine-tuned model

Revision ID: 0219_job_lineage
Revises: 0218_job_evaluations
Create Date: 2026-12-07 22:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0219_job_lineage"
down_revision = "0218_job_evaluations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("base_model", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("parent", sa.JSON(), nullable=True))
    # Every earlier job trained on the base model it names.
    op.execute("UPDATE jobs SET base_model = model")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("base_model", existing_type=sa.String(length=256), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("parent")
        batch.drop_column("base_model")
