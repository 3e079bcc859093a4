"""``/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions``: share a
fine-tuned model or checkpoint with other tenants, list and delete those permissions.

Only the tenant that owns the model (or an admin) manages them. The name may hold a
``/`` (a base model such as ``org/name``), so it is matched as a path.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query

from api.checkpoint_permissions import commands, queries
from api.checkpoint_permissions.schemas import (
    CheckpointPermissionDeleted,
    CheckpointPermissionPublic,
    CheckpointPermissionsPublic,
    PermissionCreate,
)
from api.deps import CurrentKey, SessionDep
from api.errors import error_responses
from api.pagination import MAX_LIMIT
from api.schemas.common import PageAfter

router = APIRouter(prefix="/v1/fine_tuning/checkpoints", tags=["fine-tuning"])

ModelName = Annotated[str, Path(
    description="The checkpoint's fine_tuned_model_checkpoint (ft:...:ckpt-step-N), or a fine-tuned model.")]


@router.post("/{fine_tuned_model_checkpoint:path}/permissions", response_model=CheckpointPermissionsPublic,
             responses=error_responses(400, 403, 404, 409))
def create_permissions(fine_tuned_model_checkpoint: ModelName, body: PermissionCreate, session: SessionDep,
                       key: CurrentKey) -> CheckpointPermissionsPublic:
    """Let the tenants ``project_ids`` use the model: completions and ``/v1/models``."""
    shared = queries.managed_model(session, key, fine_tuned_model_checkpoint)
    rows = commands.grant(session, shared, body.project_ids)
    return CheckpointPermissionsPublic.page([CheckpointPermissionPublic.of(r) for r in rows])


@router.get("/{fine_tuned_model_checkpoint:path}/permissions", response_model=CheckpointPermissionsPublic,
            responses=error_responses(403, 404))
def list_permissions(
    fine_tuned_model_checkpoint: ModelName, session: SessionDep, key: CurrentKey,
    project_id: Annotated[str | None, Query(description="Only this tenant's permission.")] = None,
    after: PageAfter = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Page size.")] = 10,
    order: Annotated[Literal["ascending", "descending"], Query(description="By creation time.")] = "descending",
) -> CheckpointPermissionsPublic:
    shared = queries.managed_model(session, key, fine_tuned_model_checkpoint)
    rows, has_more = queries.list_permissions(session, shared, project_id=project_id, after=after, limit=limit,
                                              order=order)
    return CheckpointPermissionsPublic.page([CheckpointPermissionPublic.of(r) for r in rows], has_more=has_more)


@router.delete("/{fine_tuned_model_checkpoint:path}/permissions/{permission_id}",
               response_model=CheckpointPermissionDeleted, responses=error_responses(403, 404))
def delete_permission(fine_tuned_model_checkpoint: ModelName, permission_id: str, session: SessionDep,
                      key: CurrentKey) -> CheckpointPermissionDeleted:
    """Take the model back from the permission's tenant, from its next request on."""
    shared = queries.managed_model(session, key, fine_tuned_model_checkpoint)
    commands.revoke(session, shared, permission_id)
    return CheckpointPermissionDeleted(id=permission_id)
