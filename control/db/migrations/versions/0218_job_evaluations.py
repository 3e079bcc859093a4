"""evaluations: held-out evaluations of a succeeded job (base vs fine-tuned, one grader)

One row per evaluation: the file, the grader, its bounds, its status and the API process
that runs it (runner, heartbeat_at: a claim whose heartbeat stopped is taken over), the
per-model results and a few sample answers.

Revision ID: 0218_job_evaluations
Revises: 0217_reinforcement_metrics
Create Date: 2026-12-07 21:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0218_job_evaluations"
down_revision = "0217_reinforcement_metrics"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("grader", sa.JSON(), nullable=False),
        sa.Column("max_samples", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("rows_done", sa.Integer(), nullable=False),
        sa.Column("rows_total", sa.Integer(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=True),
        sa.Column("samples", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("runner", sa.String(length=128), nullable=True),
        sa.Column("heartbeat_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("started_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_evaluations_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_evaluations_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
    )
    op.create_index("ix_evaluations_job_created", "evaluations", ["job_id", "created_at", "id"], unique=False)
    op.create_index("ix_evaluations_tenant_status", "evaluations", ["tenant_id", "status"], unique=False)
    op.create_index("ix_evaluations_status_heartbeat", "evaluations", ["status", "heartbeat_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_evaluations_status_heartbeat", table_name="evaluations")
    op.drop_index("ix_evaluations_tenant_status", table_name="evaluations")
    op.drop_index("ix_evaluations_job_created", table_name="evaluations")
    op.drop_table("evaluations")
