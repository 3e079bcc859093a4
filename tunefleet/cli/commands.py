"""Client commands of the `tunefleet` CLI (files, jobs, estimate, pools)."""

from __future__ import annotations

from tunefleet.cli import app  # noqa: F401
