"""Request builders shared by the sync and async resources.

Each function turns one SDK call into a ``RequestOptions`` (method, path, query, body),
so the two clients differ only in ``await`` and the wire format lives in one place.
"""

from __future__ import annotations

import mimetypes
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from tunefleet.sdk.transport import RequestOptions

JOBS = "/v1/fine_tuning/jobs"
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


def upload_file(file: FileInput, purpose: str, filename: str | None) -> RequestOptions:
    return RequestOptions(
        "POST", "/v1/files", files={"file": file_part(file, filename)}, data={"purpose": purpose}
    )


def list_params(limit: int | None, after: str | None, **extra: Any) -> dict[str, Any]:
    return {"limit": limit, "after": after, **extra}


def metadata_params(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {f"metadata[{k}]": v for k, v in (metadata or {}).items()}


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


def artifact_path(job_id: str, name: str) -> str:
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid artifact name {name!r}")
    return f"{JOBS}/{seg(job_id)}/artifacts/" + "/".join(quote(p, safe="") for p in parts)
