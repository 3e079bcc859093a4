"""Resources of the synchronous client: ``client.files``, ``client.jobs``, ...

Each method is one HTTP call (built in ``tunefleet.sdk.requests``) plus parsing into the
typed objects of ``tunefleet.sdk.types``; lists come back as auto-paginating pages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tunefleet.sdk import requests as rq
from tunefleet.sdk.downloads import ArtifactWriter, local_path
from tunefleet.sdk.errors import APIConnectionError, WaitTimeoutError
from tunefleet.sdk.pagination import SyncPage
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
    from tunefleet.sdk.client import Tunefleet

JOBS = rq.JOBS


class _Resource:
    def __init__(self, client: Tunefleet) -> None:
        self._client = client

    def _json(self, options: RequestOptions) -> Any:
        response = self._client._transport.request(options)
        return response.json() if response.content else None

    def _page(self, path: str, params: Mapping[str, Any], parse: Any, cursor_of: Any = None) -> SyncPage[Any]:
        def fetch(after: Any) -> SyncPage[Any]:
            return self._page(path, {**params, "after": after}, parse, cursor_of)

        body = self._json(RequestOptions("GET", path, params=params))
        if cursor_of is None:
            return SyncPage(body, parse, fetch)
        return SyncPage(body, parse, fetch, cursor_of)


class Files(_Resource):
    def upload(
        self,
        file: rq.FileInput,
        *,
        purpose: str = "fine-tune",
        filename: str | None = None,
        wait: bool = False,
        timeout: float | None = 300.0,
        poll_interval: float = 0.5,
    ) -> FileObject:
        """Upload a training file; with ``wait=True`` return once validation decided."""
        uploaded = FileObject.model_validate(self._json(rq.upload_file(file, purpose, filename)))
        if wait and not uploaded.is_final:
            return self.wait(uploaded.id, timeout=timeout, poll_interval=poll_interval)
        return uploaded

    def list(self, *, purpose: str | None = None, limit: int | None = None,
             after: str | None = None) -> SyncPage[FileObject]:
        params = rq.list_params(limit, after, purpose=purpose)
        return self._page("/v1/files", params, FileObject.model_validate)

    def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(self._json(RequestOptions("GET", f"/v1/files/{rq.seg(file_id)}")))

    def content(self, file_id: str) -> bytes:
        response = self._client._transport.request(
            RequestOptions("GET", f"/v1/files/{rq.seg(file_id)}/content", headers={"Accept": "*/*"})
        )
        return response.content

    def delete(self, file_id: str) -> DeletedObject:
        return DeletedObject.model_validate(self._json(RequestOptions("DELETE", f"/v1/files/{rq.seg(file_id)}")))

    def wait(self, file_id: str, *, timeout: float | None = 300.0, poll_interval: float = 0.5) -> FileObject:
        """Poll until the file is ``processed`` or ``error``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current = self.retrieve(file_id)
            if current.is_final:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"file {file_id} still {current.status} after {timeout}s", last=current)
            time.sleep(poll_interval)


class Jobs(_Resource):
    def _bind(self, data: Any) -> FineTuningJob:
        job = FineTuningJob.model_validate(data)
        job._jobs = self
        return job

    def create(self, *, model: str, training_file: str, idempotency_key: str | None = None,
               **fields: Any) -> FineTuningJob:
        """Create a job. ``fields`` are the OpenAI body fields and tunefleet extensions
        (see ``tunefleet.sdk.requests.job_body``). One idempotency key covers all retries."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        options = RequestOptions("POST", JOBS, json=body, headers=rq.idempotency_headers(idempotency_key))
        return self._bind(self._json(options))

    def estimate(self, *, model: str, training_file: str, **fields: Any) -> Estimate:
        """Dry-run placement for the same body as ``create``: memory, pool, GPUs, speed, ETA, cost."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return Estimate.model_validate(self._json(RequestOptions("POST", "/v1/fine_tuning/estimate", json=body)))

    def list(self, *, limit: int | None = None, after: str | None = None,
             metadata: Mapping[str, str] | None = None, status: str | None = None) -> SyncPage[FineTuningJob]:
        params = {**rq.list_params(limit, after, status=status), **rq.metadata_params(metadata)}
        return self._page(JOBS, params, self._bind)

    def retrieve(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}")))

    def cancel(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/cancel")))

    def pause(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/pause")))

    def resume(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(RequestOptions("POST", f"{JOBS}/{rq.seg(job_id)}/resume")))

    def list_events(self, job_id: str, *, limit: int | None = None, after: str | None = None) -> SyncPage[JobEvent]:
        return self._page(f"{JOBS}/{rq.seg(job_id)}/events", rq.list_params(limit, after), JobEvent.model_validate)

    def list_checkpoints(self, job_id: str, *, limit: int | None = None,
                         after: str | None = None) -> SyncPage[JobCheckpoint]:
        return self._page(
            f"{JOBS}/{rq.seg(job_id)}/checkpoints", rq.list_params(limit, after), JobCheckpoint.model_validate
        )

    def metrics(self, job_id: str, *, limit: int | None = None, after: int | None = None) -> SyncPage[JobMetric]:
        """Training metrics in step order; the cursor is the last step seen."""
        return self._page(
            f"{JOBS}/{rq.seg(job_id)}/metrics",
            {"limit": limit, "after": after},
            JobMetric.model_validate,
            cursor_of=lambda m: m.step,
        )

    def logs(self, job_id: str, *, tail: int | None = None) -> str:
        """The trainer log; the last ``tail`` lines (the service's default when None)."""
        response = self._client._transport.request(
            RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}/logs", params={"tail": tail}, headers={"Accept": "*/*"})
        )
        return response.text

    def list_artifacts(self, job_id: str) -> list[Artifact]:
        body = self._json(RequestOptions("GET", f"{JOBS}/{rq.seg(job_id)}/artifacts"))
        items = body.get("data", []) if isinstance(body, dict) else body
        return [Artifact.model_validate(a) for a in items]

    def download_artifact(self, job_id: str, name: str, dest: str | Path, *,
                          expected_sha256: str | None = None) -> Path:
        """Stream one artifact to ``dest`` (a file path), checking its sha256.

        Without ``expected_sha256`` the digest of the artifacts listing is used."""
        if expected_sha256 is None:
            listed = {a.name: a for a in self.list_artifacts(job_id)}
            if name in listed:
                expected_sha256 = listed[name].sha256
        writer = ArtifactWriter(Path(dest), name, expected_sha256)
        options = RequestOptions("GET", rq.artifact_path(job_id, name), stream=True, headers={"Accept": "*/*"},
                                 follow_redirects=True)
        try:
            response = self._client._transport.request(options)
            try:
                for chunk in response.iter_bytes():
                    writer.write(chunk)
            finally:
                response.close()
        except BaseException:
            writer.abort()
            raise
        return writer.finish(response.headers.get("x-checksum-sha256"))

    def download(self, job_id: str, dest_dir: str | Path, *, prefix: str = "") -> list[Path]:
        """Download every artifact whose name starts with ``prefix``, each checksum-verified."""
        dest_dir = Path(dest_dir)
        paths = []
        for artifact in self.list_artifacts(job_id):
            if artifact.name.startswith(prefix):
                target = local_path(dest_dir, artifact.name)
                paths.append(self.download_artifact(job_id, artifact.name, target, expected_sha256=artifact.sha256))
        return paths

    def wait(self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> FineTuningJob:
        """Poll until the job is succeeded, failed or cancelled; returns that final job.

        Raises:
            WaitTimeoutError: the job was still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.retrieve(job_id)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"job {job_id} still {job.status} after {timeout}s", last=job)
            time.sleep(poll_interval)

    def stream(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[StreamEvent]:
        """Live events and metrics of a job (SSE). Ends when the service closes the stream
        (the job ended); a dropped connection is resumed with ``Last-Event-ID``."""
        decoder = SSEDecoder()
        decoder.last_event_id = last_event_id
        attempt = 0
        transport = self._client._transport
        while True:
            headers = {"Accept": "text/event-stream"}
            if decoder.last_event_id:
                headers["Last-Event-ID"] = decoder.last_event_id
            options = RequestOptions(
                "GET", f"{JOBS}/{rq.seg(job_id)}/stream", headers=headers, stream=True,
                timeout=httpx.Timeout(10.0, read=None),
            )
            response = transport.request(options)
            try:
                for line in response.iter_lines():
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
                time.sleep(backoff_seconds(attempt, None))
                attempt += 1
            finally:
                response.close()


def _stream_event(message: Any) -> StreamEvent:
    try:
        data = json.loads(message.data)
    except ValueError:
        data = message.data
    return StreamEvent(event=message.event, data=data, id=message.id)


class NodePools(_Resource):
    def list(self) -> list[NodePool]:
        body = self._json(RequestOptions("GET", "/v1/node_pools"))
        items = body.get("data", []) if isinstance(body, dict) else body
        return [NodePool.model_validate(p) for p in items]


class Models(_Resource):
    """Base models and fine-tuned adapters, read only: a fine-tuned model is the adapter
    of its job, so the service has no ``DELETE /v1/models/{id}``."""

    def list(self) -> SyncPage[Model]:
        return self._page("/v1/models", {}, Model.model_validate)

    def retrieve(self, model_id: str) -> Model:
        return Model.model_validate(self._json(RequestOptions("GET", f"/v1/models/{rq.seg(model_id)}")))


class Webhooks(_Resource):
    def create(self, *, url: str, events: list[str] | None = None, description: str | None = None,
               enabled: bool = True) -> WebhookEndpoint:
        body = {"url": url, "events": events, "description": description, "enabled": enabled}
        body = {k: v for k, v in body.items() if v is not None}
        return WebhookEndpoint.model_validate(self._json(RequestOptions("POST", "/v1/webhooks", json=body)))

    def list(self, *, limit: int | None = None, after: str | None = None) -> SyncPage[WebhookEndpoint]:
        return self._page("/v1/webhooks", rq.list_params(limit, after), WebhookEndpoint.model_validate)

    def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._json(RequestOptions("GET", f"/v1/webhooks/{rq.seg(endpoint_id)}")))

    def update(self, endpoint_id: str, **changes: Any) -> WebhookEndpoint:
        options = RequestOptions("PATCH", f"/v1/webhooks/{rq.seg(endpoint_id)}", json=changes)
        return WebhookEndpoint.model_validate(self._json(options))

    def delete(self, endpoint_id: str) -> DeletedObject:
        options = RequestOptions("DELETE", f"/v1/webhooks/{rq.seg(endpoint_id)}")
        return DeletedObject.model_validate(self._json(options))

    def rotate_secret(self, endpoint_id: str, *, grace_period_s: int | None = None) -> WebhookEndpoint:
        body = {} if grace_period_s is None else {"grace_period_s": grace_period_s}
        options = RequestOptions("POST", f"/v1/webhooks/{rq.seg(endpoint_id)}/rotate_secret", json=body)
        return WebhookEndpoint.model_validate(self._json(options))

    def list_deliveries(self, endpoint_id: str, *, limit: int | None = None,
                        after: str | None = None) -> SyncPage[WebhookDelivery]:
        return self._page(
            f"/v1/webhooks/{rq.seg(endpoint_id)}/deliveries", rq.list_params(limit, after),
            WebhookDelivery.model_validate,
        )
