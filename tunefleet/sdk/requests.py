"""Request builders shared by the sync and async resources.

Each function turns one SDK call into a ``RequestOptions`` (method, path, query, body,
headers), so the two clients differ only in ``await`` and the wire format lives in one
place: ``resources.Jobs.cancel`` and ``async_resources.AsyncJobs.cancel`` both send
``cancel_job(job_id)``. List requests carry their query in ``params``; the next page is
the same request with ``after`` set (``next_page``).
"""

from __future__ import annotations

import mimetypes
import os
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx

from tunefleet.sdk.transport import RequestOptions

FILES = "/v1/files"
JOBS = "/v1/fine_tuning/jobs"
WEBHOOKS = "/v1/webhooks"
# Answers that are not JSON (file content, logs, artifacts): accept whatever comes.
ANY_CONTENT = {"Accept": "*/*"}
FileInput = str | os.PathLike[str] | bytes | IO[bytes]


def seg(value: str) -> str:
    """One URL path segment; ids never contain '/', so quoting it all is safe."""
    if not value:
        raise ValueError("an id must not be empty")
    return quote(str(value), safe="")


def idempotency_headers(key: str | None) -> dict[str, str]:
    """A fresh key per call (reused by every retry of that call) unless the caller gives one."""
    return {"Idempotency-Key": key or f"tf-{uuid.uuid4().hex}"}


def file_part(file: FileInput, filename: str | None) -> tuple[str, Any, str]:
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        name = filename or path.name
        content: Any = path.read_bytes()
    elif isinstance(file, bytes):
        name = filename or "upload.jsonl"
        content = file
    else:
        name = filename or Path(getattr(file, "name", "upload.jsonl")).name
        content = file.read()
    mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if name.endswith(".jsonl"):
        mime = "application/jsonl"
    return (name, content, mime)


def list_params(limit: int | None, after: str | None, **extra: Any) -> dict[str, Any]:
    return {"limit": limit, "after": after, **extra}


def metadata_params(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {f"metadata[{k}]": v for k, v in (metadata or {}).items()}


def list_request(path: str, limit: int | None = None, after: Any = None, **extra: Any) -> RequestOptions:
    return RequestOptions("GET", path, params=list_params(limit, after, **extra))


def next_page(options: RequestOptions, after: Any) -> RequestOptions:
    """The request of the page after ``options``' page, which ended at cursor ``after``."""
    return replace(options, params={**(options.params or {}), "after": after})


# ---------------------------------------------------------------------------- files


def upload_file(file: FileInput, purpose: str, filename: str | None) -> RequestOptions:
    return RequestOptions("POST", FILES, files={"file": file_part(file, filename)}, data={"purpose": purpose})


def list_files(purpose: str | None, limit: int | None, after: str | None) -> RequestOptions:
    return list_request(FILES, limit, after, purpose=purpose)


def retrieve_file(file_id: str) -> RequestOptions:
    return RequestOptions("GET", f"{FILES}/{seg(file_id)}")


def file_content(file_id: str) -> RequestOptions:
    return RequestOptions("GET", f"{FILES}/{seg(file_id)}/content", headers=dict(ANY_CONTENT))


def delete_file(file_id: str) -> RequestOptions:
    return RequestOptions("DELETE", f"{FILES}/{seg(file_id)}")


# ----------------------------------------------------------------------------- jobs


def job_body(
    *,
    model: str,
    training_file: str,
    validation_file: str | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    method: Mapping[str, Any] | None = None,
    suffix: str | None = None,
    seed: int | None = None,
    metadata: Mapping[str, str] | None = None,
    integrations: list[Mapping[str, Any]] | None = None,
    adapter: Mapping[str, Any] | None = None,
    trainer: str | None = None,
    placement: Mapping[str, Any] | None = None,
    priority: int | str | None = None,
    max_seq_len: int | None = None,
    packing: bool | None = None,
    eval: Mapping[str, Any] | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The create/estimate body: OpenAI fields first, tunefleet extensions alongside."""
    body: dict[str, Any] = {
        "model": model,
        "training_file": training_file,
        "validation_file": validation_file,
        "hyperparameters": dict(hyperparameters) if hyperparameters is not None else None,
        "method": dict(method) if method is not None else None,
        "suffix": suffix,
        "seed": seed,
        "metadata": dict(metadata) if metadata is not None else None,
        "integrations": [dict(i) for i in integrations] if integrations is not None else None,
        "adapter": dict(adapter) if adapter is not None else None,
        "trainer": trainer,
        "placement": dict(placement) if placement is not None else None,
        "priority": priority,
        "max_seq_len": max_seq_len,
        "packing": packing,
        "eval": dict(eval) if eval is not None else None,
    }
    body = {k: v for k, v in body.items() if v is not None}
    body.update(extra_body or {})
    return body


def create_job(body: dict[str, Any], idempotency_key: str | None) -> RequestOptions:
    """One idempotency key per create, sent again by every retry: a retry never makes two jobs."""
    return RequestOptions("POST", JOBS, json=body, headers=idempotency_headers(idempotency_key))


def estimate_job(body: dict[str, Any]) -> RequestOptions:
    return RequestOptions("POST", "/v1/fine_tuning/estimate", json=body)


def list_jobs(limit: int | None, after: str | None, metadata: Mapping[str, str] | None,
              status: str | None) -> RequestOptions:
    return list_request(JOBS, limit, after, status=status, **metadata_params(metadata))


def job_path(job_id: str, *rest: str) -> str:
    return "/".join([JOBS, seg(job_id), *rest])


def retrieve_job(job_id: str) -> RequestOptions:
    return RequestOptions("GET", job_path(job_id))


def control_job(job_id: str, action: str) -> RequestOptions:
    """``cancel``, ``pause`` or ``resume``."""
    return RequestOptions("POST", job_path(job_id, action))


def list_job_events(job_id: str, limit: int | None, after: str | None) -> RequestOptions:
    return list_request(job_path(job_id, "events"), limit, after)


def list_job_checkpoints(job_id: str, limit: int | None, after: str | None) -> RequestOptions:
    return list_request(job_path(job_id, "checkpoints"), limit, after)


def list_job_metrics(job_id: str, limit: int | None, after: int | None) -> RequestOptions:
    """Metrics page by step: ``after`` is the last step seen, not an id."""
    return list_request(job_path(job_id, "metrics"), limit, after)


def evaluation_body(file: str | None, max_samples: int | None, max_tokens: int | None,
                    grader: Mapping[str, Any] | None) -> dict[str, Any]:
    """A held-out evaluation's body; what is None is left to the service's default."""
    body = {"file": file, "max_samples": max_samples, "max_tokens": max_tokens,
            "grader": dict(grader) if grader is not None else None}
    return {k: v for k, v in body.items() if v is not None}


def create_evaluation(job_id: str, body: dict[str, Any]) -> RequestOptions:
    return RequestOptions("POST", job_path(job_id, "evaluations"), json=body)


def list_evaluations(job_id: str, limit: int | None, after: str | None) -> RequestOptions:
    return list_request(job_path(job_id, "evaluations"), limit, after)


def retrieve_evaluation(job_id: str, evaluation_id: str) -> RequestOptions:
    return RequestOptions("GET", job_path(job_id, "evaluations", seg(evaluation_id)))


def job_logs(job_id: str, tail: int | None) -> RequestOptions:
    return RequestOptions("GET", job_path(job_id, "logs"), params={"tail": tail}, headers=dict(ANY_CONTENT))


def list_job_artifacts(job_id: str) -> RequestOptions:
    return RequestOptions("GET", job_path(job_id, "artifacts"))


def artifact_path(job_id: str, name: str) -> str:
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid artifact name {name!r}")
    return f"{JOBS}/{seg(job_id)}/artifacts/" + "/".join(quote(p, safe="") for p in parts)


def download_artifact(job_id: str, name: str) -> RequestOptions:
    """A streamed download; the service may redirect it to a presigned storage URL."""
    return RequestOptions("GET", artifact_path(job_id, name), stream=True, headers=dict(ANY_CONTENT),
                          follow_redirects=True)


def job_stream(job_id: str, last_event_id: str | None) -> RequestOptions:
    """The job's SSE stream, resumed after ``last_event_id`` when given.

    No read timeout: the stream is quiet between events for as long as a step takes."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return RequestOptions("GET", job_path(job_id, "stream"), headers=headers, stream=True,
                          timeout=httpx.Timeout(10.0, read=None))


def list_data(body: Any) -> list[Any]:
    """The items of a list answer without pagination (an envelope or a bare list)."""
    return body.get("data", []) if isinstance(body, dict) else body


# ----------------------------------------------------- pools, models, chat, webhooks


def list_node_pools() -> RequestOptions:
    return RequestOptions("GET", "/v1/node_pools")


def list_models() -> RequestOptions:
    return list_request("/v1/models")


def retrieve_model(model_id: str) -> RequestOptions:
    return RequestOptions("GET", f"/v1/models/{seg(model_id)}")


def register_model(source: str, model_id: str | None, hf_id: str | None) -> RequestOptions:
    body = {"source": source, "id": model_id, "hf_id": hf_id}
    return RequestOptions("POST", "/v1/models", json={k: v for k, v in body.items() if v is not None})


def chat_completion(body: dict[str, Any]) -> RequestOptions:
    """``POST /v1/chat/completions``; a streamed one has no read timeout, as a job's stream:
    the first token may wait for the model to load."""
    if body.get("stream"):
        return RequestOptions("POST", "/v1/chat/completions", json=body, stream=True,
                              headers={"Accept": "text/event-stream"}, timeout=httpx.Timeout(10.0, read=None))
    return RequestOptions("POST", "/v1/chat/completions", json=body)


def create_webhook(url: str, events: list[str] | None, description: str | None, enabled: bool) -> RequestOptions:
    body = {"url": url, "events": events, "description": description, "enabled": enabled}
    return RequestOptions("POST", WEBHOOKS, json={k: v for k, v in body.items() if v is not None})


def list_webhooks(limit: int | None, after: str | None) -> RequestOptions:
    return list_request(WEBHOOKS, limit, after)


def retrieve_webhook(endpoint_id: str) -> RequestOptions:
    return RequestOptions("GET", f"{WEBHOOKS}/{seg(endpoint_id)}")


def update_webhook(endpoint_id: str, changes: dict[str, Any]) -> RequestOptions:
    return RequestOptions("PATCH", f"{WEBHOOKS}/{seg(endpoint_id)}", json=changes)


def delete_webhook(endpoint_id: str) -> RequestOptions:
    return RequestOptions("DELETE", f"{WEBHOOKS}/{seg(endpoint_id)}")


def rotate_webhook_secret(endpoint_id: str, grace_period_s: int | None) -> RequestOptions:
    body = {} if grace_period_s is None else {"grace_period_s": grace_period_s}
    return RequestOptions("POST", f"{WEBHOOKS}/{seg(endpoint_id)}/rotate_secret", json=body)


def list_webhook_deliveries(endpoint_id: str, limit: int | None, after: str | None) -> RequestOptions:
    return list_request(f"{WEBHOOKS}/{seg(endpoint_id)}/deliveries", limit, after)
