"""Shapes shared by every entity: the OpenAI list envelope."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Strict(BaseModel):
    """Request bodies: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class ListPublic(BaseModel, Generic[T]):
    """``{"object": "list", "data": [...], "has_more": bool, "first_id", "last_id"}``."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
