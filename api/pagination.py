"""Cursor pagination over (created_at, id), newest first, the way OpenAI's lists work.

``after`` names the last object of the previous page; the next page holds the objects
created before it. A cursor that does not name an object of the same list is a 400
``invalid_cursor`` (not an empty page, which would hide client bugs).
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from api.errors import APIError

T = TypeVar("T")

MAX_LIMIT = 100


def check_limit(limit: int) -> int:
    if limit < 1 or limit > MAX_LIMIT:
        raise APIError(400, "invalid_request", f"limit must be between 1 and {MAX_LIMIT}.",
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
    check_limit(limit)
    if after is not None:
        anchor = session.execute(
            query.with_only_columns(model.created_at, model.id).where(model.id == after)
        ).first()
        if anchor is None:
            raise APIError(400, "invalid_cursor", f"'after' is not an id in this list: '{after}'.",
                           param="after")
        created, anchor_id = anchor
        query = query.where(
            or_(model.created_at < created, and_(model.created_at == created, model.id < anchor_id))
        )
    rows = list(
        session.scalars(query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1))
    )
    return rows[:limit], len(rows) > limit
