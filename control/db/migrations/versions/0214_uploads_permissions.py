"""uploads, upload_parts: files sent in parts; checkpoint_permissions: models shared with other tenants

Revision ID: 0214_uploads_permissions
Revises: 0213_reports_and_exports
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0214_uploads_permissions"
down_revision = "0213_reports_and_exports"
branch_labels = None
depends_on = None


def _utc(name: str, *, nullable: bool) -> sa.Column:
    return sa.Column(name, control.db.base.UTCDateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("mime_type", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("file_expires_after_s", sa.Integer(), nullable=True),
        sa.Column("file_id", sa.String(64), nullable=True),
        _utc("created_at", nullable=False),
        _utc("expires_at", nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_uploads_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_uploads_file_id_files")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_uploads")),
    )
    op.create_index("ix_uploads_tenant_created", "uploads", ["tenant_id", "created_at"])
    op.create_index("ix_uploads_status_expires", "uploads", ["status", "expires_at"])
    op.create_table(
        "upload_parts",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("upload_id", sa.String(64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("location", sa.String(1024), nullable=False),
        _utc("created_at", nullable=False),
        sa.ForeignKeyConstraint(["upload_id"], ["uploads.id"], name=op.f("fk_upload_parts_upload_id_uploads"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upload_parts")),
    )
    op.create_index(op.f("ix_upload_parts_upload_id"), "upload_parts", ["upload_id"])
    op.create_table(
        "checkpoint_permissions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(600), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("project_id", sa.String(64), nullable=False),
        _utc("created_at", nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_checkpoint_permissions_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["project_id"], ["tenants.id"],
                                name=op.f("fk_checkpoint_permissions_project_id_tenants"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_permissions")),
        sa.UniqueConstraint("model", "project_id", name="uq_checkpoint_permissions_model_project"),
    )
    op.create_index(op.f("ix_checkpoint_permissions_job_id"), "checkpoint_permissions", ["job_id"])
    op.create_index("ix_checkpoint_permissions_project", "checkpoint_permissions", ["project_id", "created_at"])


def downgrade() -> None:
    op.drop_table("checkpoint_permissions")
    op.drop_table("upload_parts")
    op.drop_table("uploads")
