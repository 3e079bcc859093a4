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


def _next_cursor(body: dict[str, Any], items: list[Any], cursor_of: Callable[[Any], Any]) -> Any:
    if body.get("last_id"):
        return body["last_id"]
    return cursor_of(items[-1]) if items else None


class SyncPage(Generic[T]):
    """One page of a list; ``for item in page`` continues through the following pages."""

    def __init__(
        self,
        body: dict[str, Any],
        parse: Callable[[Any], T],
        fetch_after: Callable[[Any], SyncPage[T]],
        cursor_of: Callable[[T], Any] = lambda item: item.id,
    ) -> None:
        self.data: list[T] = [parse(item) for item in body.get("data", [])]
        self.has_more: bool = bool(body.get("has_more", False))
        self.next_cursor = _next_cursor(body, self.data, cursor_of)
        self._fetch_after = fetch_after

    def next_page(self) -> SyncPage[T] | None:
        if not self.has_more or self.next_cursor is None:
            return None
        return self._fetch_after(self.next_cursor)

    def iter_pages(self) -> Iterator[SyncPage[T]]:
        page: SyncPage[T] | None = self
        while page is not None:
            yield page
            page = page.next_page()

    def __iter__(self) -> Iterator[T]:
        for page in self.iter_pages():
            yield from page.data

    def __len__(self) -> int:  # items of THIS page
        return len(self.data)


class AsyncPage(Generic[T]):
    """Async twin of ``SyncPage``: ``async for item in await client.jobs.list()``."""

    def __init__(
        self,
        body: dict[str, Any],
        parse: Callable[[Any], T],
        fetch_after: Callable[[Any], Awaitable[AsyncPage[T]]],
        cursor_of: Callable[[T], Any] = lambda item: item.id,
    ) -> None:
        self.data: list[T] = [parse(item) for item in body.get("data", [])]
        self.has_more: bool = bool(body.get("has_more", False))
        self.next_cursor = _next_cursor(body, self.data, cursor_of)
        self._fetch_after = fetch_after

    async def next_page(self) -> AsyncPage[T] | None:
        if not self.has_more or self.next_cursor is None:
            return None
        return await self._fetch_after(self.next_cursor)

    async def iter_pages(self) -> AsyncIterator[AsyncPage[T]]:
        page: AsyncPage[T] | None = self
        while page is not None:
            yield page
            page = await page.next_page()

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.iter_pages():
            for item in page.data:
                yield item

    def __len__(self) -> int:
        return len(self.data)
