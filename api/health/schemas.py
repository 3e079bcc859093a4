"""``/healthz`` and ``/readyz`` answers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class HealthPublic(BaseModel):
    status: Literal["ok"] = "ok"


class ReadinessPublic(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(
        description="Each dependency (database, broker, worker) with 'ok' or why it is not."
    )
