"""What a running or finished job produces: metrics, logs, artifacts and a live stream.

``GET /v1/fine_tuning/jobs/{id}/metrics``   time series, ascending by step (cursor ``after``)
``GET /v1/fine_tuning/jobs/{id}/logs``      the trainer log (``?tail=N`` lines, text/plain)
``GET /v1/fine_tuning/jobs/{id}/artifacts`` output files with bytes and sha256
``GET /v1/fine_tuning/jobs/{id}/artifacts/{name}``  one file (stream, or 307 to S3)
``GET /v1/fine_tuning/jobs/{id}/checkpoints/{checkpoint id}/artifacts[/{name}]``
    the PEFT adapter of any checkpoint (its files with sha256, and each file)
``POST /v1/fine_tuning/jobs/{id}/exports``  a merged model, made in the background (job events)
``GET /v1/fine_tuning/jobs/{id}/stream``    SSE: events (incl. status changes) and metrics
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import (
    CurrentKey,
    QueueDep,
    SessionDep,
    SessionFactoryDep,
    SettingsDep,
    StreamSlotsDep,
)
from api.errors import error_responses
from api.jobs.queries import get_job
from api.outputs import stream
from api.outputs.logs import read_job_log
from api.outputs.schemas import ArtifactsPublic, ExportCreate, ExportPublic, MetricsPublic
from api.responses import EventStreamResponse, OctetStreamResponse, attachment
from control.artifacts import ArtifactStore, open_or_404, safe_key, sha256_stored, store_for
from control.db.models import ApiKey, Artifact, Checkpoint, Job, JobMetric
from control.errors import APIError
from control.exports import request_export
from control.jobs.lifecycle import add_event
from control.reports.ingest import ADAPTER_WEIGHTS, is_inside, job_storage
from control.reports.schemas import GRADING_METRICS, METHOD_METRICS
from control.settings import Settings

log = logging.getLogger(__name__)

RowT = TypeVar("RowT", Artifact, Checkpoint)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning outputs"])

METRIC_FIELDS = (
    "step", "total_steps", "epoch", "train_loss", "valid_loss", "token_accuracy",
    "valid_token_accuracy", "learning_rate", "grad_norm", "tokens_per_s", "mfu", "tokens_seen",
    "memory_bytes", "time",
)


def metric_dict(row: JobMetric) -> dict[str, Any]:
    """A metric row as the API shows it; a DPO or reinforcement run's own metrics under
    their reported names."""
    out = {"object": "fine_tuning.job.metric", **{f: getattr(row, f) for f in METRIC_FIELDS}}
    out.update({name: getattr(row, column) for name, column in METHOD_METRICS.items()})
    out.update({name: getattr(row, name) for name in GRADING_METRICS})
    return out


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=error_responses(404))
def list_metrics(
    job_id: str, session: SessionDep, key: CurrentKey,
    after: Annotated[int | None, Query(ge=-1, description="Last step already seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    job = get_job(session, key, job_id)
    query = select(JobMetric).where(JobMetric.job_id == job.id)
    if after is not None:
        query = query.where(JobMetric.step > after)
    rows = list(session.scalars(query.order_by(JobMetric.step).limit(limit + 1)))
    data = [metric_dict(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "has_more": len(rows) > limit,
            "last_step": data[-1]["step"] if data else None}


@router.get("/{job_id}/logs", response_model=None, response_class=PlainTextResponse,
            responses=error_responses(404, 502))
def job_logs(
    job_id: str, session: SessionDep, key: CurrentKey, settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, le=100_000)] = 200,
) -> PlainTextResponse:
    job = get_job(session, key, job_id)
    return PlainTextResponse(read_job_log(job, settings, tail))


def _artifact_dict(row: Artifact) -> dict[str, Any]:
    return {"object": "fine_tuning.job.artifact", "name": row.name, "bytes": row.bytes,
            "sha256": row.sha256}


@router.get("/{job_id}/artifacts", response_model=ArtifactsPublic,
            responses=error_responses(404))
def list_artifacts(job_id: str, session: SessionDep, key: CurrentKey) -> dict[str, Any]:
    job = get_job(session, key, job_id)
    rows = session.scalars(select(Artifact).where(Artifact.job_id == job.id).order_by(Artifact.name))
    data = [_artifact_dict(r) for r in rows]
    return {"object": "list", "data": data, "has_more": False}


@router.get("/{job_id}/artifacts/{name:path}", response_model=None, response_class=OctetStreamResponse, responses={
    307: {"description": "The artifact lives in S3: a presigned URL in `Location` (15 min)."},
    **error_responses(404),
})
def download_artifact(
    job_id: str, name: str, session: SessionDep, key: CurrentKey, settings: SettingsDep
) -> Response:
    """Stream one output file, or redirect (307) to a presigned URL when it lives in S3."""
    job = get_job(session, key, job_id)
    object_key = safe_key(name)
    row = _stored_row(session.scalar(select(Artifact).where(Artifact.job_id == job.id, Artifact.name == object_key)),
                      job_storage(job.id, settings).outputs, kind="artifact", name=object_key, job=job,
                      where="the job's output", param="name")
    store = store_for(row.location, s3_endpoint_url=settings.s3_endpoint_url)
    url = store.presigned_url(object_key, expires_s=900)
    if url is not None:
        return RedirectResponse(url, status_code=307)
    opened = open_or_404(store, object_key, APIError(
        404, "artifact_not_found", f"Artifact '{object_key}' of job '{job.id}' is registered but missing on disk.",
        param="name"))
    return attachment(opened, filename=object_key.rsplit("/", 1)[-1], headers={"X-Checksum-Sha256": row.sha256})


def _stored_row(row: RowT | None, prefixes: tuple[str, ...], *, kind: str, name: str, job: Job,
                where: str, param: str) -> RowT:
    """``row`` (an artifact or a checkpoint of ``job``), else 404 ``<kind>_not_found``: when
    there is none, and when its location is outside ``prefixes``, the job's own storage (a
    row registered before locations were confined there would otherwise hand out whatever
    its location points at)."""
    if row is None:
        raise APIError(404, f"{kind}_not_found", f"Job '{job.id}' has no {kind} '{name}'.", param=param)
    if is_inside(row.location, prefixes):
        return row
    log.warning("%s %s of job %s has a location outside %s: %r", kind, name, job.id, where, row.location)
    raise APIError(404, f"{kind}_not_found",
                   f"{kind.capitalize()} '{name}' of job '{job.id}' is not in {where}.", param=param)


# ---- a checkpoint's adapter ---------------------------------------------------------

CHECKPOINT_ADAPTER = "adapter"


def _checkpoint_adapter(session: Session, key: ApiKey, settings: Settings, job_id: str,
                        checkpoint_id: str) -> tuple[Job, ArtifactStore]:
    """The job's checkpoint and the store rooted at its adapter directory (404s otherwise)."""
    job = get_job(session, key, job_id)
    row = _stored_row(session.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id,
                                                              Checkpoint.id == checkpoint_id)),
                      job_storage(job.id, settings).checkpoints, kind="checkpoint", name=checkpoint_id,
                      job=job, where="the job's storage", param="checkpoint_id")
    store = store_for(f"{row.location.rstrip('/')}/{CHECKPOINT_ADAPTER}", s3_endpoint_url=settings.s3_endpoint_url)
    return job, store


def _stored_adapter_files(store: ArtifactStore, job: Job, checkpoint_id: str) -> list[str]:
    names = store.list()
    if not names:
        raise APIError(404, "checkpoint_not_stored",
                       f"Checkpoint '{checkpoint_id}' of job '{job.id}' is no longer stored (only the "
                       "last checkpoints are kept); its metrics remain in the checkpoint list.",
                       param="checkpoint_id")
    return names


@router.get("/{job_id}/checkpoints/{checkpoint_id}/artifacts", response_model=ArtifactsPublic,
            responses=error_responses(404))
def list_checkpoint_artifacts(
    job_id: str, checkpoint_id: str, session: SessionDep, key: CurrentKey, settings: SettingsDep
) -> dict[str, Any]:
    """The checkpoint's PEFT adapter files, with bytes and sha256 (read from storage)."""
    job, store = _checkpoint_adapter(session, key, settings, job_id, checkpoint_id)
    data = [{"object": "fine_tuning.job.artifact", "name": name, "bytes": store.size(name),
             "sha256": sha256_stored(store, name)} for name in _stored_adapter_files(store, job, checkpoint_id)]
    return {"object": "list", "data": data, "has_more": False}


@router.get("/{job_id}/checkpoints/{checkpoint_id}/artifacts/{name:path}", response_model=None,
            response_class=OctetStreamResponse, responses={
                307: {"description": "The checkpoint lives in S3: a presigned URL in `Location` (15 min)."},
                **error_responses(404),
            })
def download_checkpoint_artifact(
    job_id: str, checkpoint_id: str, name: str, session: SessionDep, key: CurrentKey, settings: SettingsDep
) -> Response:
    """One file of the checkpoint's adapter: streamed with its sha256, or a 307 to S3."""
    job, store = _checkpoint_adapter(session, key, settings, job_id, checkpoint_id)
    object_key = safe_key(name)
    if object_key not in _stored_adapter_files(store, job, checkpoint_id):
        raise APIError(404, "artifact_not_found",
                       f"Checkpoint '{checkpoint_id}' has no adapter file '{object_key}'.", param="name")
    url = store.presigned_url(object_key, expires_s=900)
    if url is not None:
        return RedirectResponse(url, status_code=307)
    missing = APIError(404, "checkpoint_not_stored", f"Checkpoint '{checkpoint_id}' of job '{job.id}' is no "
                       "longer stored (only the last checkpoints are kept).", param="checkpoint_id")
    try:  # a checkpoint pruned while this request runs is a 404 at any point before the answer
        sha256 = sha256_stored(store, object_key)
    except FileNotFoundError:
        raise missing from None
    opened = open_or_404(store, object_key, missing)
    return attachment(opened, filename=object_key.rsplit("/", 1)[-1], headers={"X-Checksum-Sha256": sha256})


# ---- merged exports -----------------------------------------------------------------


@router.post("/{job_id}/exports", response_model=ExportPublic,
             responses=error_responses(400, 404, 409, 429))
def create_export(job_id: str, body: ExportCreate, session: SessionDep, key: CurrentKey,
                  settings: SettingsDep, queue: QueueDep) -> ExportPublic:
    """Merge the job's final adapter (or a checkpoint's) into its base model, in the background.

    Progress and the result are job events; the files appear among the job's artifacts
    under ``artifacts_prefix``. Asking again for an export that is queued, running or
    finished answers that export (``control.exports``).
    """
    job = get_job(session, key, job_id)
    output = session.scalar(select(Artifact.location).where(Artifact.job_id == job.id,
                                                            Artifact.name == ADAPTER_WEIGHTS))
    if body.checkpoint is None and (job.status != "succeeded" or output is None):
        raise APIError(409, "job_not_succeeded",
                       f"Job '{job.id}' has no final adapter yet; export a checkpoint or wait for it to succeed.")
    if body.checkpoint is not None:
        _job, store = _checkpoint_adapter(session, key, settings, job_id, body.checkpoint)
        _stored_adapter_files(store, job, body.checkpoint)
    if job_storage(job.id, settings).outputs[0].startswith("s3://"):
        raise APIError(400, "export_needs_local_storage",
                       "Merged exports need the job's outputs on the service's own disk (local artifact store).")
    row, created = request_export(session, job, body.checkpoint, body.dtype,
                                  settings.export_max_concurrent_per_tenant)
    export = ExportPublic.of(row)
    if created:
        add_event(session, job, f"Merged export {export.id} queued", data=export.model_dump())
    session.commit()
    if created:
        queue.send("tunefleet.export_merged", job.id, export.id, body.dtype, body.checkpoint)
    return export


# ---- live stream (Server-Sent Events) ---------------------------------------------


@router.get("/{job_id}/stream", response_model=None, response_class=EventStreamResponse,
            responses=error_responses(404, 429))
async def stream_job(
    job_id: str, request: Request, session: SessionDep, key: CurrentKey,
    factory: SessionFactoryDep, slots: StreamSlotsDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Events (status changes included) and metrics as they arrive; ends when the job does.

    Reconnect with ``Last-Event-ID`` (the ``id`` of the last message seen) to resume. Open
    streams are capped per API key and per service process (429 ``too_many_streams``).
    """
    job = await run_in_threadpool(get_job, session, key, job_id)
    # The request's session would otherwise keep its connection for as long as the stream
    # stays open; each poll takes its own connection and gives it back.
    await run_in_threadpool(session.close)
    release = slots.take(key.id)
    messages = stream.job_messages(request, factory, job.id, stream.parse_cursor(last_event_id), metric_dict)
    return stream.SlotStreamResponse(messages, release,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
