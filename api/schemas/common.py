"""Shapes shared by every entity: the OpenAI list envelope and its query parameters."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, Self, TypeVar

from fastapi import Query
from pydantic import BaseModel, BeforeValidator, ConfigDict

from api.pagination import MAX_LIMIT

T = TypeVar("T")


def _whole_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After ``Field(strict=True, ...)`` on an int: JSON has one number type and JSON Schema
# counts 1.0 as an integer, so a strict integer field takes a whole float; strings and
# booleans stay errors (strict), and so do 1.5, NaN and infinities.
AcceptWholeFloats = BeforeValidator(_whole_number)


class Strict(BaseModel):
    """Request bodies: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class PublicObject(BaseModel):
    """An object as answered: every field is always sent, so the document marks each one
    required, those with a default (``object``) and those that may be null included."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class ListPublic(BaseModel, Generic[T]):
    """``{"object": "list", "data": [...], "has_more": bool, "first_id", "last_id"}``."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    # OpenAI types both as strings its file list always has: an empty page has "" (no id).
    first_id: str = ""
    last_id: str = ""

    @classmethod
    def page(cls, data: list[T], *, has_more: bool = False) -> Self:
        """The page of ``data`` (objects with an ``id``): ``first_id`` and ``last_id`` are
        the ids at its two ends, "" for an empty page."""
        ids = [item.id for item in data[:1] + data[-1:]]  # type: ignore[attr-defined]
        return cls(data=data, has_more=has_more, first_id=ids[0] if ids else "",
                   last_id=ids[-1] if ids else "")


# The query parameters of the newest-first lists (api.pagination.page_newest_first).
PageLimit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Page size.")]
PageAfter = Annotated[str | None, Query(
    description="The id of the last object of the previous page; an id that is not in "
    "this list is a 400 invalid_cursor.",
)]
