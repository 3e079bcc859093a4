"""Cursor pagination: list envelopes as pages that iterate over every item.

The service answers lists as ``{"object": "list", "data": [...], "has_more": bool}``;
the next page is requested with ``after=<cursor of the last item>`` (the item's id for
jobs, events, files, checkpoints; ``last_id`` wins when the envelope carries it).
Iterating a page walks all following pages lazily, one request per page.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

T = TypeVar("T", bound=BaseModel)
FetchT = TypeVar("FetchT")


def _next_cursor(body: dict[str, Any], items: list[Any], cursor_of: Callable[[Any], Any]) -> Any:
    if body.get("last_id"):
        return body["last_id"]
    return cursor_of(items[-1]) if items else None


class _Page(Generic[T, FetchT]):
    """What a sync and an async page share: the parsed items of one envelope, whether
    more follow, and the cursor to fetch them with (``fetch_after(next_cursor)``)."""

    def __init__(
        self,
        body: dict[str, Any],
        parse: Callable[[Any], T],
        fetch_after: Callable[[Any], FetchT],
        cursor_of: Callable[[T], Any] = lambda item: item.id,
    ) -> None:
        self.data: list[T] = [parse(item) for item in body.get("data", [])]
        self.has_more: bool = bool(body.get("has_more", False))
        self.next_cursor = _next_cursor(body, self.data, cursor_of)
        self._fetch_after = fetch_after

    def _fetch_next(self) -> FetchT | None:
        """The next page's fetch (a page, or an awaitable of one), or None after the last page."""
        if not self.has_more or self.next_cursor is None:
            return None
        return self._fetch_after(self.next_cursor)

    def __len__(self) -> int:  # items of THIS page
        return len(self.data)


class SyncPage(_Page[T, "SyncPage[T]"]):
    """One page of a list; ``for item in page`` continues through the following pages."""

    def next_page(self) -> SyncPage[T] | None:
        return self._fetch_next()

    def iter_pages(self) -> Iterator[SyncPage[T]]:
        page: SyncPage[T] | None = self
        while page is not None:
            yield page
            page = page.next_page()

    def __iter__(self) -> Iterator[T]:
        for page in self.iter_pages():
            yield from page.data


class AsyncPage(_Page[T, Awaitable["AsyncPage[T]"]]):
    """Async twin of ``SyncPage``: ``async for item in await client.jobs.list()``."""

    async def next_page(self) -> AsyncPage[T] | None:
        fetch = self._fetch_next()
        return None if fetch is None else await fetch

    async def iter_pages(self) -> AsyncIterator[AsyncPage[T]]:
        page: AsyncPage[T] | None = self
        while page is not None:
            yield page
            page = await page.next_page()

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.iter_pages():
            for item in page.data:
                yield item
