"""The two entry points of the SDK: ``Tunefleet`` (sync) and ``AsyncTunefleet``.

    with Tunefleet(base_url="http://127.0.0.1:8000", api_key="tf_...") as client:
        for job in client.jobs.list():
            print(job.id, job.status)

Arguments left out come from the environment or the config file (see
``tunefleet.sdk.config``). ``http_client`` lets tests and proxies inject a configured
``httpx`` client (the SDK sets its base URL and auth headers on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Self, TypeVar

import httpx

from tunefleet.sdk.async_resources import (
    AsyncFiles,
    AsyncJobs,
    AsyncModels,
    AsyncNodePools,
    AsyncWebhooks,
)
from tunefleet.sdk.config import resolve_config
from tunefleet.sdk.resources import Chat, Files, Jobs, Models, NodePools, Webhooks
from tunefleet.sdk.transport import (
    DEFAULT_MAX_RETRIES,
    AsyncTransport,
    RequestOptions,
    SyncTransport,
)

HttpClientT = TypeVar("HttpClientT", httpx.Client, httpx.AsyncClient)
TransportT = TypeVar("TransportT", SyncTransport, AsyncTransport)


class _Client(Generic[HttpClientT, TransportT]):
    """What both clients share: the configuration resolved once and the transport built
    from it; each client names its transport class and attaches its resources to it."""

    _transport_class: type[TransportT]

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: HttpClientT | None = None,
    ) -> None:
        config = resolve_config(base_url, api_key)
        self.base_url = config.base_url
        self.api_key = config.api_key
        self._transport: TransportT = self._transport_class(
            base_url=config.base_url, api_key=config.api_key, timeout=timeout, max_retries=max_retries,
            default_headers=default_headers, http_client=http_client,
        )
        self._attach_resources(self._transport)

    def _attach_resources(self, transport: TransportT) -> None:
        raise NotImplementedError


class Tunefleet(_Client[httpx.Client, SyncTransport]):
    """Synchronous client. Resources: ``files``, ``jobs``, ``node_pools``, ``models``, ``webhooks``,
    ``chat.completions``."""

    _transport_class = SyncTransport

    def _attach_resources(self, transport: SyncTransport) -> None:
        self.files = Files(transport)
        self.jobs = Jobs(transport)
        self.node_pools = NodePools(transport)
        self.models = Models(transport)
        self.webhooks = Webhooks(transport)
        self.chat = Chat(transport)

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: is the API process up."""
        return self._transport.request(RequestOptions("GET", "/healthz")).json()

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTunefleet(_Client[httpx.AsyncClient, AsyncTransport]):
    """Asynchronous client; every resource method is a coroutine (``stream`` an async iterator)."""

    _transport_class = AsyncTransport

    def _attach_resources(self, transport: AsyncTransport) -> None:
        self.files = AsyncFiles(transport)
        self.jobs = AsyncJobs(transport)
        self.node_pools = AsyncNodePools(transport)
        self.models = AsyncModels(transport)
        self.webhooks = AsyncWebhooks(transport)

    async def health(self) -> dict[str, Any]:
        return (await self._transport.request(RequestOptions("GET", "/healthz"))).json()

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
