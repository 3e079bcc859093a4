"""Operator commands of the `tunefleet` CLI (serve, worker, scheduler, db, admin)."""

from __future__ import annotations

from tunefleet.cli import app  # noqa: F401
