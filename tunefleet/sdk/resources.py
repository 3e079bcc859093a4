"""Resources of the synchronous client: ``client.files``, ``client.jobs``, ...

Each method is one HTTP call (built in ``tunefleet.sdk.requests``) plus parsing into the
typed objects of ``tunefleet.sdk.types``; lists come back as auto-paginating pages. The
asynchronous twins in ``async_resources`` send the same requests; what the two share
beyond the requests (stream decoding, download plans, wait deadlines) lives in
``streaming``, ``downloads`` and ``waiting``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from tunefleet.sdk import requests as rq
from tunefleet.sdk.downloads import ArtifactWriter, download_plan, listed_sha256
from tunefleet.sdk.pagination import SyncPage
from tunefleet.sdk.sse import SSEDecoder
from tunefleet.sdk.streaming import JobStream
from tunefleet.sdk.transport import RequestOptions, SyncTransport
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


class _Resource:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport

    def _send(self, options: RequestOptions) -> httpx.Response:
        return self._transport.request(options)

    def _json(self, options: RequestOptions) -> Any:
        response = self._send(options)
        return response.json() if response.content else None

    def _poll(self, fetch: Callable[[], Any], done: Callable[[Any], bool], what: str,
              timeout: float | None, poll_interval: float) -> Any:
        """``fetch()`` every ``poll_interval`` seconds until ``done``; that last object."""
        deadline = WaitDeadline(timeout)
        while True:
            current = fetch()
            if done(current):
                return current
            deadline.check(what, current)
            time.sleep(poll_interval)

    def _page(self, options: RequestOptions, parse: Callable[[Any], Any],
              cursor_of: Callable[[Any], Any] | None = None) -> SyncPage[Any]:
        def fetch(after: Any) -> SyncPage[Any]:
            return self._page(rq.next_page(options, after), parse, cursor_of)

        body = self._json(options)
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
        return self._page(rq.list_files(purpose, limit, after), FileObject.model_validate)

    def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(self._json(rq.retrieve_file(file_id)))

    def content(self, file_id: str) -> bytes:
        return self._send(rq.file_content(file_id)).content

    def delete(self, file_id: str) -> DeletedObject:
        return DeletedObject.model_validate(self._json(rq.delete_file(file_id)))

    def wait(self, file_id: str, *, timeout: float | None = 300.0, poll_interval: float = 0.5) -> FileObject:
        """Poll until the file is ``processed`` or ``error``."""
        return self._poll(lambda: self.retrieve(file_id), lambda f: f.is_final, f"file {file_id}",
                          timeout, poll_interval)


class Jobs(_Resource):
    def _bind(self, data: Any) -> FineTuningJob:
        return FineTuningJob.bound(data, self)

    def create(self, *, model: str, training_file: str, idempotency_key: str | None = None,
               **fields: Any) -> FineTuningJob:
        """Create a job. ``fields`` are the OpenAI body fields and tunefleet extensions
        (see ``tunefleet.sdk.requests.job_body``). One idempotency key covers all retries."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return self._bind(self._json(rq.create_job(body, idempotency_key)))

    def estimate(self, *, model: str, training_file: str, **fields: Any) -> Estimate:
        """Dry-run placement for the same body as ``create``: memory, pool, GPUs, speed, ETA, cost."""
        body = rq.job_body(model=model, training_file=training_file, **fields)
        return Estimate.model_validate(self._json(rq.estimate_job(body)))

    def list(self, *, limit: int | None = None, after: str | None = None,
             metadata: Mapping[str, str] | None = None, status: str | None = None) -> SyncPage[FineTuningJob]:
        return self._page(rq.list_jobs(limit, after, metadata, status), self._bind)

    def retrieve(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(rq.retrieve_job(job_id)))

    def cancel(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(rq.control_job(job_id, "cancel")))

    def pause(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(rq.control_job(job_id, "pause")))

    def resume(self, job_id: str) -> FineTuningJob:
        return self._bind(self._json(rq.control_job(job_id, "resume")))

    def list_events(self, job_id: str, *, limit: int | None = None, after: str | None = None) -> SyncPage[JobEvent]:
        return self._page(rq.list_job_events(job_id, limit, after), JobEvent.model_validate)

    def list_checkpoints(self, job_id: str, *, limit: int | None = None,
                         after: str | None = None) -> SyncPage[JobCheckpoint]:
        return self._page(rq.list_job_checkpoints(job_id, limit, after), JobCheckpoint.model_validate)

    def metrics(self, job_id: str, *, limit: int | None = None, after: int | None = None) -> SyncPage[JobMetric]:
        """Training metrics in step order; the cursor is the last step seen."""
        return self._page(rq.list_job_metrics(job_id, limit, after), JobMetric.model_validate,
                          cursor_of=lambda m: m.step)

    def logs(self, job_id: str, *, tail: int | None = None) -> str:
        """The trainer log; the last ``tail`` lines (the service's default when None)."""
        return self._send(rq.job_logs(job_id, tail)).text

    def list_artifacts(self, job_id: str) -> list[Artifact]:
        return [Artifact.model_validate(a) for a in rq.list_data(self._json(rq.list_job_artifacts(job_id)))]

    def download_artifact(self, job_id: str, name: str, dest: str | Path, *,
                          expected_sha256: str | None = None) -> Path:
        """Stream one artifact to ``dest`` (a file path), checking its sha256.

        Without ``expected_sha256`` the digest of the artifacts listing is used."""
        if expected_sha256 is None:
            expected_sha256 = listed_sha256(self.list_artifacts(job_id), name)
        writer = ArtifactWriter(Path(dest), name, expected_sha256)
        try:
            response = self._send(rq.download_artifact(job_id, name))
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
        return [self.download_artifact(job_id, artifact.name, target, expected_sha256=artifact.sha256)
                for artifact, target in download_plan(self.list_artifacts(job_id), Path(dest_dir), prefix)]

    def evaluate(self, job_id: str, *, file: str | None = None, max_samples: int | None = None,
                 max_tokens: int | None = None, grader: Mapping[str, Any] | None = None) -> Evaluation:
        """Start a held-out evaluation of a succeeded job: its base and fine-tuned models answer
        ``file``'s rows (default: the job's validation file), graded by ``grader`` (default:
        exact match). It runs in the background; ``wait_evaluation`` waits for it."""
        body = rq.evaluation_body(file, max_samples, max_tokens, grader)
        return Evaluation.model_validate(self._json(rq.create_evaluation(job_id, body)))

    def list_evaluations(self, job_id: str, *, limit: int | None = None,
                         after: str | None = None) -> SyncPage[Evaluation]:
        return self._page(rq.list_evaluations(job_id, limit, after), Evaluation.model_validate)

    def retrieve_evaluation(self, job_id: str, evaluation_id: str) -> Evaluation:
        return Evaluation.model_validate(self._json(rq.retrieve_evaluation(job_id, evaluation_id)))

    def wait_evaluation(self, job_id: str, evaluation_id: str, *, timeout: float | None = None,
                        poll_interval: float = 1.0) -> Evaluation:
        """Poll until the evaluation has succeeded or failed; returns it.

        Raises:
            WaitTimeoutError: it was still queued or running after ``timeout`` seconds."""
        return self._poll(lambda: self.retrieve_evaluation(job_id, evaluation_id), lambda e: e.is_final,
                          f"evaluation {evaluation_id}", timeout, poll_interval)

    def wait(self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> FineTuningJob:
        """Poll until the job is succeeded, failed or cancelled; returns that final job.

        Raises:
            WaitTimeoutError: the job was still running after ``timeout`` seconds."""
        return self._poll(lambda: self.retrieve(job_id), lambda j: j.is_terminal, f"job {job_id}",
                          timeout, poll_interval)

    def stream(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[StreamEvent]:
        """Live events and metrics of a job (SSE). Ends when the service closes the stream
        (the job ended); a dropped connection is resumed with ``Last-Event-ID``."""
        stream = JobStream(job_id, last_event_id, self._transport.max_retries)
        while True:
            response = self._send(stream.request())
            try:
                for line in response.iter_lines():
                    event = stream.feed(line)
                    if event is not None:
                        yield event
                event = stream.close()
                if event is not None:
                    yield event
                return
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                time.sleep(stream.retry_delay(exc))
            finally:
                response.close()


class NodePools(_Resource):
    def list(self) -> list[NodePool]:
        return [NodePool.model_validate(p) for p in rq.list_data(self._json(rq.list_node_pools()))]


class Models(_Resource):
    """Base models and fine-tuned adapters; admins also register base models."""

    def list(self) -> SyncPage[Model]:
        return self._page(rq.list_models(), Model.model_validate)

    def retrieve(self, model_id: str) -> Model:
        return Model.model_validate(self._json(rq.retrieve_model(model_id)))

    def register(self, *, source: str, id: str | None = None, hf_id: str | None = None) -> Model:
        """Register a base model (an admin key): a directory or ``s3://`` checkpoint answers
        ``status: ready``, a Hub id ``org/name[@revision]`` answers ``fetching``."""
        return Model.model_validate(self._json(rq.register_model(source, id, hf_id)))


class ChatCompletions(_Resource):
    def create(self, *, model: str, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """A chat completion: OpenAI's ``chat.completion`` object, as a dict. ``params`` are
        the body's other fields (``max_tokens``, ``temperature``, ...); for a stream use ``stream``."""
        return self._json(rq.chat_completion({"model": model, "messages": messages, **params, "stream": False}))

    def stream(self, *, model: str, messages: list[dict[str, Any]], **params: Any) -> Iterator[dict[str, Any]]:
        """The completion's ``chat.completion.chunk`` objects as the service sends them
        (each token's text is in ``choices[i].delta.content``), until ``data: [DONE]``."""
        response = self._send(rq.chat_completion({"model": model, "messages": messages, **params, "stream": True}))
        decoder = SSEDecoder()
        try:
            for line in [*response.iter_lines(), ""]:
                message = decoder.feed(line)
                if message is None:
                    continue
                if message.data.strip() == "[DONE]":
                    return
                yield json.loads(message.data)
        finally:
            response.close()


class Chat:
    """``client.chat.completions``, as in OpenAI's SDK."""

    def __init__(self, transport: SyncTransport) -> None:
        self.completions = ChatCompletions(transport)


class Webhooks(_Resource):
    def create(self, *, url: str, events: list[str] | None = None, description: str | None = None,
               enabled: bool = True) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._json(rq.create_webhook(url, events, description, enabled)))

    def list(self, *, limit: int | None = None, after: str | None = None) -> SyncPage[WebhookEndpoint]:
        return self._page(rq.list_webhooks(limit, after), WebhookEndpoint.model_validate)

    def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._json(rq.retrieve_webhook(endpoint_id)))

    def update(self, endpoint_id: str, **changes: Any) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._json(rq.update_webhook(endpoint_id, changes)))

    def delete(self, endpoint_id: str) -> DeletedObject:
        return DeletedObject.model_validate(self._json(rq.delete_webhook(endpoint_id)))

    def rotate_secret(self, endpoint_id: str, *, grace_period_s: int | None = None) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._json(rq.rotate_webhook_secret(endpoint_id, grace_period_s)))

    def list_deliveries(self, endpoint_id: str, *, limit: int | None = None,
                        after: str | None = None) -> SyncPage[WebhookDelivery]:
        return self._page(rq.list_webhook_deliveries(endpoint_id, limit, after), WebhookDelivery.model_validate)
