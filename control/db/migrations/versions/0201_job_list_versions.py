"""job_list_versions: a per-tenant change counter of the jobs table (for the job list cache)

Revision ID: 0201_job_list_versions
Revises: 0101_webhooks
Create Date: 2026-11-29 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0201_job_list_versions"
down_revision = "0101_webhooks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Written by hand to match JobListVersion in control/db/models.py (checked by
    # tests/api/test_job_list_cache.py). No rows are backfilled: a tenant without a row
    # gets one, atomically, with the first write to its jobs (control/db/job_versions.py).
    op.create_table(
        "job_list_versions",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_job_list_versions_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_job_list_versions")),
    )


def downgrade() -> None:
    op.drop_table("job_list_versions")
