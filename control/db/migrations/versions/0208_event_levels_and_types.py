"""job_events: OpenAI's levels and types only (debug -> info, a checkpoint event is a message)

Events written before: a trainer's ``debug`` events kept that level, which OpenAI's
clients refuse (its levels are info, warn, error), and "Checkpoint created" events had
the type ``metrics``, which OpenAI's clients read as a step's metrics.

Revision ID: 0208_event_levels_and_types
Revises: 0207_file_expiry
Create Date: 2026-12-01 14:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0208_event_levels_and_types"
down_revision = "0207_file_expiry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE job_events SET level = 'info' WHERE level = 'debug'")
    op.execute("UPDATE job_events SET level = 'warn' WHERE level = 'warning'")
    op.execute("UPDATE job_events SET type = 'message' WHERE type = 'metrics'")


def downgrade() -> None:
    # The old levels and types are not kept; the rows stay valid for the older code.
    pass
