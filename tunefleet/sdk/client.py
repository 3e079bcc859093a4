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
from typing import Any, Self

import httpx

from tunefleet.sdk.async_resources import (
    AsyncFiles,
    AsyncJobs,
    AsyncModels,
    AsyncNodePools,
    AsyncWebhooks,
)
from tunefleet.sdk.config import resolve_config
from tunefleet.sdk.resources import Files, Jobs, Models, NodePools, Webhooks
from tunefleet.sdk.transport import (
    DEFAULT_MAX_RETRIES,
    AsyncTransport,
    RequestOptions,
    SyncTransport,
)


class Tunefleet:
    """Synchronous client. Resources: ``files``, ``jobs``, ``node_pools``, ``models``, ``webhooks``."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        config = resolve_config(base_url, api_key)
        self.base_url = config.base_url
        self.api_key = config.api_key
        self._transport = SyncTransport(
            base_url=config.base_url, api_key=config.api_key, timeout=timeout, max_retries=max_retries,
            default_headers=default_headers, http_client=http_client,
        )
        self.files = Files(self)
        self.jobs = Jobs(self)
        self.node_pools = NodePools(self)
        self.models = Models(self)
        self.webhooks = Webhooks(self)

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: is the API process up."""
        return self._transport.request(RequestOptions("GET", "/healthz")).json()

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTunefleet:
    """Asynchronous client; every resource method is a coroutine (``stream`` an async iterator)."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        config = resolve_config(base_url, api_key)
        self.base_url = config.base_url
        self.api_key = config.api_key
        self._transport = AsyncTransport(
            base_url=config.base_url, api_key=config.api_key, timeout=timeout, max_retries=max_retries,
            default_headers=default_headers, http_client=http_client,
        )
        self.files = AsyncFiles(self)
        self.jobs = AsyncJobs(self)
        self.node_pools = AsyncNodePools(self)
        self.models = AsyncModels(self)
        self.webhooks = AsyncWebhooks(self)

    async def health(self) -> dict[str, Any]:
        return (await self._transport.request(RequestOptions("GET", "/healthz"))).json()

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
