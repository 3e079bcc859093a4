"""Resources of the asynchronous client; the same calls as ``resources``, with ``await``.

Both send the requests of ``tunefleet.sdk.requests`` and share stream decoding, download
plans and wait deadlines (``streaming``, ``downloads``, ``waiting``); only the I/O differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from tunefleet.sdk import requests as rq
from tunefleet.sdk.downloads import ArtifactWriter, download_plan, listed_sha256
from tunefleet.sdk.pagination import AsyncPage
from tunefleet.sdk.streaming import JobStream
from tunefleet.sdk.transport import AsyncTransport, RequestOptions
from tunefleet.sdk.types import (
    Artifact,
    DeletedObject,
    Estimate,
    Evaluation,
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
from tunefleet.sdk.waiting import WaitDeadline


class _AsyncResource:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def _send(self, options: RequestOptions) -> httpx.Response:
        return await self._transport.request(options)

    async def _json(self, options: RequestOptions) -> Any:
        response = await self._send(options)
        return response.json() if response.content else None

    async def _poll(self, fetch: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], what: str,
                    timeout: float | None, poll_interval: float) -> Any:
        """``await fetch()`` every ``poll_interval`` seconds until ``done``; that last object."""
        deadline = WaitDeadline(timeout)
        while True:
            current = await fetch()
            if done(current):
                return current
            deadline.check(what, current)
            await asyncio.sleep(poll_interval)

    async def _page(self, options: RequestOptions, parse: Callable[[Any], Any],
                    cursor_of: Callable[[Any], Any] | None = None) -> AsyncPage[Any]:
        async def fetch(after: Any) -> AsyncPage[Any]:
            return await self._page(rq.next_page(options, after), parse, cursor_of)

        body = await self._json(options)
        if cursor_of is None:
            return AsyncPage(body, parse, fetch)
        return AsyncPage(body, parse, fetch, cursor_of)


class AsyncFiles(_AsyncResource):
    async def upload(
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
        uploaded = FileObject.model_validate(await self._json(rq.upload_file(file, purpose, filename)))
        if wait and not uploaded.is_final:
            return await self.wait(uploaded.id, timeout=timeout, poll_interval=poll_interval)
        return uploaded

    async def list(self, *, purpose: str | None = None, limit: int | None = None,
                   after: str | None = None) -> AsyncPage[FileObject]:
        return await self._page(rq.list_files(purpose, limit, after), FileObject.model_validate)

    async def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(await self._json(rq.retrieve_file(file_id)))

    async def content(self, file_id: str) -> bytes:
        return (await self._send(rq.file_content(file_id))).content

    async def delete(self, file_id: str) -> DeletedObject:
        return DeletedObject.model_validate(await self._json(rq.delete_file(file_id)))

    async def wait(self, file_id: str, *, timeout: float | None = 300.0,
                   poll_interval: float = 0.5) -> FileObject:
        """Poll until the file is ``processed`` or ``error``."""
        return await self._poll(lambda: self.retrieve(file_id), lambda f: f.is_final, f"file {file_id}",
                                timeout, poll_interval)


class AsyncJobs(_AsyncResource):
    def _bind(self, data: Any) -> FineTuningJob:
        return FineTuningJob.bound(data, self)

    async def create(self, *, model: str, training_file: str, idempotency_key: str | None = None,
                     **fields: Any) -> FineTuningJob:
        """Create a job. ``fields`` are the OpenAI body fields and tunefleet extensions
        (see ``tunefleet.sdk.requests.job_body``). One idempotency key covers all retries."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return self._bind(await self._json(rq.create_job(body, idempotency_key)))

    async def estimate(self, *, model: str, training_file: str, **fields: Any) -> Estimate:
        """Dry-run placement for the same body as ``create``: memory, pool, GPUs, speed, ETA, cost."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return Estimate.model_validate(await self._json(rq.estimate_job(body)))

    async def list(self, *, limit: int | None = None, after: str | None = None,
                   metadata: Mapping[str, str] | None = None,
                   status: str | None = None) -> AsyncPage[FineTuningJob]:
        return await self._page(rq.list_jobs(limit, after, metadata, status), self._bind)

    async def retrieve(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(rq.retrieve_job(job_id)))

    async def cancel(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(rq.control_job(job_id, "cancel")))

    async def pause(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(rq.control_job(job_id, "pause")))

    async def resume(self, job_id: str) -> FineTuningJob:
        return self._bind(await self._json(rq.control_job(job_id, "resume")))

    async def list_events(self, job_id: str, *, limit: int | None = None,
                          after: str | None = None) -> AsyncPage[JobEvent]:
        return await self._page(rq.list_job_events(job_id, limit, after), JobEvent.model_validate)

    async def list_checkpoints(self, job_id: str, *, limit: int | None = None,
                               after: str | None = None) -> AsyncPage[JobCheckpoint]:
        return await self._page(rq.list_job_checkpoints(job_id, limit, after), JobCheckpoint.model_validate)

    async def metrics(self, job_id: str, *, limit: int | None = None,
                      after: int | None = None) -> AsyncPage[JobMetric]:
        """Training metrics in step order; the cursor is the last step seen."""
        return await self._page(rq.list_job_metrics(job_id, limit, after), JobMetric.model_validate,
                                cursor_of=lambda m: m.step)

    async def logs(self, job_id: str, *, tail: int | None = None) -> str:
        """The trainer log; the last ``tail`` lines (the service's default when None)."""
        return (await self._send(rq.job_logs(job_id, tail))).text

    async def list_artifacts(self, job_id: str) -> list[Artifact]:
        body = await self._json(rq.list_job_artifacts(job_id))
        return [Artifact.model_validate(a) for a in rq.list_data(body)]

    async def download_artifact(self, job_id: str, name: str, dest: str | Path, *,
                                expected_sha256: str | None = None) -> Path:
        """Stream one artifact to ``dest`` (a file path), checking its sha256.

        Without ``expected_sha256`` the digest of the artifacts listing is used."""
        if expected_sha256 is None:
            expected_sha256 = listed_sha256(await self.list_artifacts(job_id), name)
        writer = ArtifactWriter(Path(dest), name, expected_sha256)
        try:
            response = await self._send(rq.download_artifact(job_id, name))
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
        """Download every artifact whose name starts with ``prefix``, each checksum-verified."""
        plan = download_plan(await self.list_artifacts(job_id), Path(dest_dir), prefix)
        return [await self.download_artifact(job_id, artifact.name, target, expected_sha256=artifact.sha256)
                for artifact, target in plan]

    async def evaluate(self, job_id: str, *, file: str | None = None, max_samples: int | None = None,
                       max_tokens: int | None = None, grader: Mapping[str, Any] | None = None) -> Evaluation:
        """Start a held-out evaluation of a succeeded job: its base and fine-tuned models answer
        ``file``'s rows (default: the job's validation file), graded by ``grader`` (default:
        exact match). It runs in the background; ``wait_evaluation`` waits for it."""
        body = rq.evaluation_body(file, max_samples, max_tokens, grader)
        return Evaluation.model_validate(await self._json(rq.create_evaluation(job_id, body)))

    async def list_evaluations(self, job_id: str, *, limit: int | None = None,
                               after: str | None = None) -> AsyncPage[Evaluation]:
        return await self._page(rq.list_evaluations(job_id, limit, after), Evaluation.model_validate)

    async def retrieve_evaluation(self, job_id: str, evaluation_id: str) -> Evaluation:
        return Evaluation.model_validate(await self._json(rq.retrieve_evaluation(job_id, evaluation_id)))

    async def wait_evaluation(self, job_id: str, evaluation_id: str, *, timeout: float | None = None,
                              poll_interval: float = 1.0) -> Evaluation:
        """Poll until the evaluation has succeeded or failed; returns it.

        Raises:
            WaitTimeoutError: it was still queued or running after ``timeout`` seconds."""
        return await self._poll(lambda: self.retrieve_evaluation(job_id, evaluation_id), lambda e: e.is_final,
                                f"evaluation {evaluation_id}", timeout, poll_interval)

    async def wait(self, job_id: str, *, timeout: float | None = None,
                   poll_interval: float = 1.0) -> FineTuningJob:
        """Poll until the job is succeeded, failed or cancelled; returns that final job.

        Raises:
            WaitTimeoutError: the job was still running after ``timeout`` seconds."""
        return await self._poll(lambda: self.retrieve(job_id), lambda j: j.is_terminal, f"job {job_id}",
                                timeout, poll_interval)

    async def stream(self, job_id: str, *, last_event_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Live events and metrics of a job (SSE). Ends when the service closes the stream
        (the job ended); a dropped connection is resumed with ``Last-Event-ID``."""
        stream = JobStream(job_id, last_event_id, self._transport.max_retries)
        while True:
            response = await self._send(stream.request())
            try:
                async for line in response.aiter_lines():
                    event = stream.feed(line)
                    if event is not None:
                        yield event
                event = stream.close()
                if event is not None:
                    yield event
                return
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                await asyncio.sleep(stream.retry_delay(exc))
            finally:
                await response.aclose()


class AsyncNodePools(_AsyncResource):
    async def list(self) -> list[NodePool]:
        body = await self._json(rq.list_node_pools())
        return [NodePool.model_validate(p) for p in rq.list_data(body)]


class AsyncModels(_AsyncResource):
    """Base models and fine-tuned adapters; admins also register base models."""

    async def list(self) -> AsyncPage[Model]:
        return await self._page(rq.list_models(), Model.model_validate)

    async def retrieve(self, model_id: str) -> Model:
        return Model.model_validate(await self._json(rq.retrieve_model(model_id)))

    async def register(self, *, source: str, id: str | None = None, hf_id: str | None = None) -> Model:
        return Model.model_validate(await self._json(rq.register_model(source, id, hf_id)))


class AsyncWebhooks(_AsyncResource):
    async def create(self, *, url: str, events: list[str] | None = None, description: str | None = None,
                     enabled: bool = True) -> WebhookEndpoint:
        options = rq.create_webhook(url, events, description, enabled)
        return WebhookEndpoint.model_validate(await self._json(options))

    async def list(self, *, limit: int | None = None, after: str | None = None) -> AsyncPage[WebhookEndpoint]:
        return await self._page(rq.list_webhooks(limit, after), WebhookEndpoint.model_validate)

    async def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(await self._json(rq.retrieve_webhook(endpoint_id)))

    async def update(self, endpoint_id: str, **changes: Any) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(await self._json(rq.update_webhook(endpoint_id, changes)))

    async def delete(self, endpoint_id: str) -> DeletedObject:
        return DeletedObject.model_validate(await self._json(rq.delete_webhook(endpoint_id)))

    async def rotate_secret(self, endpoint_id: str, *, grace_period_s: int | None = None) -> WebhookEndpoint:
        options = rq.rotate_webhook_secret(endpoint_id, grace_period_s)
        return WebhookEndpoint.model_validate(await self._json(options))

    async def list_deliveries(self, endpoint_id: str, *, limit: int | None = None,
                              after: str | None = None) -> AsyncPage[WebhookDelivery]:
        options = rq.list_webhook_deliveries(endpoint_id, limit, after)
        return await self._page(options, WebhookDelivery.model_validate)
