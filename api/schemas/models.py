"""``/v1/models`` schemas: OpenAI's ``model`` object, for base models and fine-tuned adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.schemas.common import ListPublic


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int | None
    owned_by: str
    kind: Literal["base", "adapter"]
    architecture: str | None = Field(None, description="Base models: the architecture.")
    max_seq_len: int | None = Field(None, description="Base models: the longest sequence.")
    parent: str | None = Field(None, description="Adapters: the base model trained on.")
    fine_tuning_job: str | None = Field(None, description="Adapters: the job that made it.")


ModelsPublic = ListPublic[ModelPublic]


class ModelDeleted(BaseModel):
    """OpenAI's answer to deleting a model."""

    id: str
    object: Literal["model"] = "model"
    deleted: bool = True
