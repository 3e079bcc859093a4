"""job_metrics: what a reinforcement step's grading said (sub_rewards, grader_errors)

``sub_rewards``: a multi grader's sub-grader name -> its mean reward over the step's
completions; ``grader_errors``: the step's completions the grader could not score. Both
null on the rows of other runs and of reinforcement runs reported before them.

Revision ID: 0220_grading_metrics
Revises: 0219_job_lineage
Create Date: 2026-12-08 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0220_grading_metrics"
down_revision = "0219_job_lineage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        batch.add_column(sa.Column("sub_rewards", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("grader_errors", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        batch.drop_column("grader_errors")
        batch.drop_column("sub_rewards")
