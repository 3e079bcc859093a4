"""``/v1/models`` schemas: OpenAI's ``model`` object, for base models and fine-tuned adapters,
and the registration of a base model by an admin."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.common import ListPublic


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int | None
    owned_by: str
    kind: Literal["base", "adapter"]
    architecture: str | None = Field(None, description="Base models: the architecture.")
    max_seq_len: int | None = Field(None, description="Base models: the longest sequence.")
    parent: str | None = Field(None, description="Adapters: the model their job started from: a base model, or the "
                               "fine-tuned model (or checkpoint) it continued.")
    root: str | None = Field(None, description="Adapters: the base model at the root of their lineage, which the "
                             "adapter applies to (the parent's lineage is folded into it).")
    fine_tuning_job: str | None = Field(None, description="Adapters: the job that made it.")
    source: str | None = Field(None, description="Registered base models: the source registered.")
    status: Literal["ready", "fetching", "failed"] | None = Field(
        None, description="Registered base models: ready to train on, being fetched from the Hub, or failed.")
    revision: str | None = Field(None, description="Hub models: the commit fetched.")
    error: dict[str, str] | None = Field(None, description="A failed registration: {code, message}.")


ModelsPublic = ListPublic[ModelPublic]


class ModelCreate(BaseModel):
    """``POST /v1/models`` (admins): register a base model."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(
        None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][\w.@/-]*$",
        description="The id jobs name as their model; default: the Hub repo id of a Hub source.")
    source: str = Field(
        min_length=1, max_length=1024,
        description="An absolute directory or s3:// prefix of a Hugging Face checkpoint, or a Hub id "
        "org/name[@revision] (when the operator allows that repo).")
    hf_id: str | None = Field(
        None, min_length=1, max_length=256,
        description="The Hub id exported adapters name as their base model; default: the Hub repo, or the id.")


class ModelDeleted(BaseModel):
    """OpenAI's answer to deleting a model."""

    id: str
    object: Literal["model"] = "model"
    deleted: bool = True
