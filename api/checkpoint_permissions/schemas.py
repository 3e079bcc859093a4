"""Checkpoint permission schemas: OpenAI's ``checkpoint.permission``, its list and deletion."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from api.schemas.common import ListPublic, PublicObject, Strict
from control.db.base import to_unix
from control.db.models import CheckpointPermission

# Tenants one request may grant (OpenAI sets no number; the list must stay a request's worth).
MAX_PROJECT_IDS = 100


class PermissionCreate(Strict):
    """``POST /v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions``."""

    project_ids: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=MAX_PROJECT_IDS,
        description="Ids of the organizations (tenants, org-...) of this service to share the model with.")


class CheckpointPermissionPublic(PublicObject):
    """OpenAI's ``checkpoint.permission``; ``project_id`` is the tenant the model is shared with."""

    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    created_at: int
    project_id: str

    @classmethod
    def of(cls, row: CheckpointPermission) -> CheckpointPermissionPublic:
        return cls(id=row.id, created_at=to_unix(row.created_at) or 0, project_id=row.project_id)


CheckpointPermissionsPublic = ListPublic[CheckpointPermissionPublic]


class CheckpointPermissionDeleted(PublicObject):
    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    deleted: bool = True
