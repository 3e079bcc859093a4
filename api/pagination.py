"""Cursor pagination over (created_at, id), newest first, the way OpenAI's lists work.

``after`` names the last object of the previous page; the next page holds the objects
created before it (after it, in a list in ascending order). A cursor that does not name
an object of the same list is a 400 ``invalid_cursor`` (not an empty page, which would
hide client bugs).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from control.errors import APIError

T = TypeVar("T")

MAX_LIMIT = 100


def check_limit(limit: int, max_limit: int = MAX_LIMIT) -> int:
    if limit < 1 or limit > max_limit:
        raise APIError(400, "invalid_request", f"limit must be between 1 and {max_limit}.",
                       param="limit")
    return limit


def page_newest_first(
    session: Session, query: Select[Any], model: Any, *, after: str | None, limit: int,
    cursor_exists: Select[Any] | None = None,
) -> tuple[list[Any], bool]:
    """One page of ``query`` ordered newest first; returns (rows, has_more).

    Args:
        query: a select of ``model`` already filtered to what the caller may see.
        model: the mapped class (needs ``created_at`` and ``id``).
        after: the id of the last row of the previous page, or None.
        limit: page size (1..100).
    """
    return page_by_created(session, query, model, after=after, limit=limit)


def page_by_created(
    session: Session, query: Select[Any], model: Any, *, after: str | None, limit: int,
    order: Literal["asc", "desc"] = "desc", max_limit: int = MAX_LIMIT,
) -> tuple[list[Any], bool]:
    """One page of ``query`` by creation time, newest first (``desc``) or oldest first
    (``asc``); returns (rows, has_more). ``limit`` is 1..``max_limit``."""
    check_limit(limit, max_limit)
    if after is not None:
        anchor = session.execute(
            query.with_only_columns(model.created_at, model.id).where(model.id == after)
        ).first()
        if anchor is None:
            raise APIError(400, "invalid_cursor", f"'after' is not an id in this list: '{after}'.",
                           param="after")
        created, anchor_id = anchor
        if order == "asc":
            query = query.where(
                or_(model.created_at > created, and_(model.created_at == created, model.id > anchor_id))
            )
        else:
            query = query.where(
                or_(model.created_at < created, and_(model.created_at == created, model.id < anchor_id))
            )
    keys = (model.created_at, model.id) if order == "asc" else (model.created_at.desc(), model.id.desc())
    rows = list(session.scalars(query.order_by(*keys).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
