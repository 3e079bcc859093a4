"""Resources of the asynchronous client; same calls as ``resources`` with ``await``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tunefleet.sdk import requests as rq
from tunefleet.sdk.downloads import ArtifactWriter, local_path
from tunefleet.sdk.errors import APIConnectionError, WaitTimeoutError
from tunefleet.sdk.pagination import AsyncPage
from tunefleet.sdk.resources import _stream_event
from tunefleet.sdk.sse import SSEDecoder
from tunefleet.sdk.transport import RequestOptions, backoff_seconds
from tunefleet.sdk.types import (
    Artifact,
    DeletedObject,
    Estimate,
    FileObject,
    FineTuningJob,
    JobCheckpoint,
    JobEvent,
    JobMetric,
    Model,
    NodePool,
    StreamEvent,
    WebhookDelivery,
    WebhookEndpoint,
)

if TYPE_CHECKING:
    from tunefleet.sdk.client import AsyncTunefleet

JOBS = rq.JOBS


class _AsyncResource:
    def __init__(self, client: AsyncTunefleet) -> None:
        self._client = client

    async def _json(self, options: RequestOptions) -> Any:
        response = await self._client._transport.request(options)
        return response.json() if response.content else None

    async def _page(self, path: str, params: Mapping[str, Any], parse: Any, cursor_of: Any = None) -> AsyncPage[Any]:
        async def fetch(after: Any) -> AsyncPage[Any]:
            return await self._page(path, {**params, "after": after}, parse, cursor_of)

        body = await self._json(RequestOptions("GET", path, params=params))
        if cursor_of is None:
            return AsyncPage(body, parse, fetch)
        return AsyncPage(body, parse, fetch, cursor_of)


class AsyncFiles(_AsyncResource):
    async def upload(self, file: rq.FileInput, *, purpose: str = "fine-tune", filename: str | None = None,
                     wait: bool = False, timeout: float | None = 300.0, poll_interval: float = 0.5) -> FileObject:
        uploaded = FileObject.model_validate(await self._json(rq.upload_file(file, purpose, filename)))
        if wait and not uploaded.is_final:
            return await self.wait(uploaded.id, timeout=timeout, poll_interval=poll_interval)
        return uploaded

    async def list(self, *, purpose: str | None = None, limit: int | None = None,
                   after: str | None = None) -> AsyncPage[FileObject]:
        params = rq.list_params(limit, after, purpose=purpose)
        return await self._page("/v1/files", params, FileObject.model_validate)

    async def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(await self._json(RequestOptions("GET", f"/v1/files/{rq.seg(file_id)}")))

    async def content(self, file_id: str) -> bytes:
        options = RequestOptions("GET", f"/v1/files/{rq.seg(file_id)}/content", headers={"Accept": "*/*"})
        return (await self._client._transport.request(options)).content

    async def delete(self, file_id: str) -> DeletedObject:
        options = RequestOptions("DELETE", f"/v1/files/{rq.seg(file_id)}")
        return DeletedObject.model_validate(await self._json(options))

    async def wait(self, file_id: str, *, timeout: float | None = 300.0, poll_interval: float = 0.5) -> FileObject:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current = await self.retrieve(file_id)
            if current.is_final:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"file {file_id} still {current.status} after {timeout}s", last=current)
            await asyncio.sleep(poll_interval)


class AsyncJobs(_AsyncResource):
    def _bind(self, data: Any) -> FineTuningJob:
        job = FineTuningJob.model_validate(data)
        job._jobs = self
        return job

    async def create(self, *, model: str, training_file: str, idempotency_key: str | None = None,
                     **fields: Any) -> FineTuningJob:
        body = rq.job_body(model=model, training_file=training_file, **fields)
        options = RequestOptions("POST", JOBS, json=body, headers=rq.idempotency_headers(idempotency_key))
        return self._bind(await self._json(options))

    async def estimate(self, *, model: str, training_file: str, **fields: Any) -> Estimate:
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return Estimate.model_validate(await self._json(RequestOptions("POST", "/v1/fine_tuning/estimate", json=body)))

    async def list(self, *, limit: int | None = None, after: str | None = None,
                   metadata: Mapping[str, str] | None = None, status: str | None = None) -> AsyncPage[FineTuningJob]:
        params = {**rq.list_params(limit, after, status=status), **rq.metadata_params(metadata)}
        return await self._page(JOBS, params, self._bind)

    async def retrieve(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}")))

    async def cancel(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/cancel")))

    async def pause(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/pause")))

    async def resume(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/resume")))

    async def list_events(self, job_id: str, *, limit: int | None = None,
                          after: str | None = None) -> AsyncPage[JobEvent]:
        return await self._page(f"{JOBS}/{rq.seg(job_id)}/events", rq.list_params(limit, after),
                                JobEvent.model_validate)

    async def list_checkpoints(self, job_id: str, *, limit: int | None = None,
                               after: str | None = None) -> AsyncPage[JobCheckpoint]:
        return await self._page(f"{JOBS}/{rq.seg(job_id)}/checkpoints", rq.list_params(limit, after),
                                JobCheckpoint.model_validate)

    async def metrics(self, job_id: str, *, limit: int | None = None, after: int | None = None) -> AsyncPage[JobMetric]:
        return await self._page(f"{JOBS}/{rq.seg(job_id)}/metrics", {"limit": limit, "after": after},
                                JobMetric.model_validate, cursor_of=lambda m: m.step)

    async def logs(self, job_id: str, *, tail: int | None = None) -> str:
        options = RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}/logs", params={"tail": tail},
                                 headers={"Accept": "*/*"})
        return (await self._client._transport.request(options)).text

    async def list_artifacts(self, job_id: str) -> list[Artifact]:
        body = await self._json(RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}/artifacts"))
        items = body.get("data", []) if isinstance(body, dict) else body
        return [Artifact.model_validate(a) for a in items]

    async def download_artifact(self, job_id: str, name: str, dest: str | Path, *,
                                expected_sha256: str | None = None) -> Path:
        if expected_sha256 is None:
            listed = {a.name: a for a in await self.list_artifacts(job_id)}
            if name in listed:
                expected_sha256 = listed[name].sha256
        writer = ArtifactWriter(Path(dest), name, expected_sha256)
        options = RequestOptions("GET", rq.artifact_path(job_id, name), stream=True, headers={"Accept": "*/*"},
                                 follow_redirects=True)
        try:
            response = await self._client._transport.request(options)
            try:
                async for chunk in response.aiter_bytes():
                    writer.write(chunk)
            finally:
                await response.aclose()
        except BaseException:
            writer.abort()
            raise
        return writer.finish(response.headers.get("x-checksum-sha256"))

    async def download(self, job_id: str, dest_dir: str | Path, *, prefix: str = "") -> list[Path]:
        dest_dir = Path(dest_dir)
        paths = []
        for artifact in await self.list_artifacts(job_id):
            if artifact.name.startswith(prefix):
                target = local_path(dest_dir, artifact.name)
                paths.append(await self.download_artifact(job_id, artifact.name, target,
                                                          expected_sha256=artifact.sha256))
        return paths

    async def wait(self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> FineTuningJob:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = await self.retrieve(job_id)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"job {job_id} still {job.status} after {timeout}s", last=job)
            await asyncio.sleep(poll_interval)

    async def stream(self, job_id: str, *, last_event_id: str | None = None) -> AsyncIterator[StreamEvent]:
        decoder = SSEDecoder()
        decoder.last_event_id = last_event_id
        attempt = 0
        transport = self._client._transport
        while True:
            headers = {"Accept": "text/event-stream"}
            if decoder.last_event_id:
                headers["Last-Event-ID"] = decoder.last_event_id
            options = RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}/stream", headers=headers, stream=True,
                                     timeout=httpx.Timeout(10.0, read=None))
            response = await transport.request(options)
            try:
                async for line in response.aiter_lines():
                    message = decoder.feed(line)
                    if message is not None:
                        attempt = 0
                        yield _stream_event(message)
                message = decoder.feed("")
                if message is not None:
                    yield _stream_event(message)
                return
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                if attempt >= transport.max_retries:
                    raise APIConnectionError(f"event stream of {job_id} dropped: {exc}") from exc
                await asyncio.sleep(backoff_seconds(attempt, None))
                attempt += 1
            finally:
                await response.aclose()


class AsyncNodePools(_AsyncResource):
    async def list(self) -> list[NodePool]:
        body = await self._json(RequestOptions("GET", "/v1/node_pools"))
        items = body.get("data", []) if isinstance(body, dict) else body
        return [NodePool.model_validate(p) for p in items]


class AsyncModels(_AsyncResource):
    """Base models and fine-tuned adapters, read only: a fine-tuned model is the adapter
    of its job, so the service has no ``DELETE /v1/models/{id}``."""

    async def list(self) -> AsyncPage[Model]:
        return await self._page("/v1/models", {}, Model.model_validate)

    async def retrieve(self, model_id: str) -> Model:
        return Model.model_validate(await self._json(RequestOptions("GET", f"/v1/models/{rq.seg(model_id)}")))


class AsyncWebhooks(_AsyncResource):
    async def create(self, *, url: str, events: list[str] | None = None, description: str | None = None,
                     enabled: bool = True) -> WebhookEndpoint:
        body = {k: v for k, v in {"url": url, "events": events, "description": description,
                                  "enabled": enabled}.items() if v is not None}
        return WebhookEndpoint.model_validate(await self._json(RequestOptions("POST", "/v1/webhooks", json=body)))

    async def list(self, *, limit: int | None = None, after: str | None = None) -> AsyncPage[WebhookEndpoint]:
        return await self._page("/v1/webhooks", rq.list_params(limit, after), WebhookEndpoint.model_validate)

    async def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        options = RequestOptions("GET", f"/v1/webhooks/{rq.seg(endpoint_id)}")
        return WebhookEndpoint.model_validate(await self._json(options))

    async def update(self, endpoint_id: str, **changes: Any) -> WebhookEndpoint:
        options = RequestOptions("PATCH", f"/v1/webhooks/{rq.seg(endpoint_id)}", json=changes)
        return WebhookEndpoint.model_validate(await self._json(options))

    async def delete(self, endpoint_id: str) -> DeletedObject:
        options = RequestOptions("DELETE", f"/v1/webhooks/{rq.seg(endpoint_id)}")
        return DeletedObject.model_validate(await self._json(options))

    async def rotate_secret(self, endpoint_id: str, *, grace_period_s: int | None = None) -> WebhookEndpoint:
        body = {} if grace_period_s is None else {"grace_period_s": grace_period_s}
        options = RequestOptions("POST", f"/v1/webhooks/{rq.seg(endpoint_id)}/rotate_secret", json=body)
        return WebhookEndpoint.model_validate(await self._json(options))

    async def list_deliveries(self, endpoint_id: str, *, limit: int | None = None,
                              after: str | None = None) -> AsyncPage[WebhookDelivery]:
        return await self._page(f"/v1/webhooks/{rq.seg(endpoint_id)}/deliveries", rq.list_params(limit, after),
                                WebhookDelivery.model_validate)
