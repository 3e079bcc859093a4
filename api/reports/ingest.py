"""Applying trainer report batches: metrics, events, checkpoints, artifacts, errors.

A batch is applied exactly once: its ``(job_id, seq)`` row is inserted in the same
transaction as its items, so a retried batch (the trainer never saw the answer) hits
the unique constraint and is answered ``duplicate: true`` without changing anything.

Authentication uses the per-job token (only its sha256 is stored): no or an unknown
token is a 401; a valid token of another job is a 404 for this job; the token of a job
that stopped running more than ``REPORT_GRACE_S`` ago (``STOPPING_GRACE_S`` while its run
has no outcome yet) is a 401 ``job_token_expired``.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.artifacts import safe_key
from api.db.base import utcnow
from api.db.models import Artifact, Checkpoint, Job, JobEvent, JobMetric, ReportBatch
from api.errors import APIError
from api.ids import hash_secret, new_id
from api.jobs.lifecycle import add_event, lock_job, start_admitted_launch
from api.jobs.schemas import checkpoint_model_id, fine_tuned_model_id
from api.reports.schemas import (
    PREFERENCE_METRICS,
    ArtifactsItem,
    CheckpointItem,
    ErrorItem,
    EventItem,
    MetricItem,
    ReportBatchIn,
)
from api.settings import Settings, resolved_dir

# Trainer metric names -> OpenAI checkpoint metric names.
CHECKPOINT_METRIC_NAMES = {
    "step": "step",
    "train_loss": "train_loss",
    "token_accuracy": "train_mean_token_accuracy",
    "train_mean_token_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_token_accuracy": "valid_mean_token_accuracy",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
    "full_valid_loss": "full_valid_loss",
    "full_valid_mean_token_accuracy": "full_valid_mean_token_accuracy",
    **{name: name for name in PREFERENCE_METRICS},
}
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"
# The report protocol's event levels, as OpenAI's (info, warn, error): a trainer's debug
# message is shown as info.
TRAINER_EVENT_LEVELS = {"debug": "info", "info": "info", "warn": "warn", "warning": "warn", "error": "error"}
# At most this many evenly spaced steps of a run get a metrics event (see metrics_event).
METRIC_EVENTS_PER_RUN = 50
# How long after a job stopped running its trainer may still deliver its last batches.
REPORT_GRACE_S = 60.0
STOPPING_GRACE_S = 600.0  # while the job's run has not ended (no outcome of its attempt yet)


def authenticate_job(session: Session, job_id: str, authorization: str | None) -> Job:
    """The job a report is for, if the bearer token is that job's; else 401/404."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "invalid_job_token", "Missing job token (Authorization: Bearer).")
    owner = session.scalar(select(Job).where(Job.job_token_hash == hash_secret(token)))
    if owner is None:
        raise APIError(401, "invalid_job_token", "Unknown or rotated job token.")
    if owner.id != job_id:
        raise APIError(404, "not_found", f"No fine-tuning job found with id '{job_id}'.")
    if not accepts_reports(session, owner):
        raise APIError(401, "job_token_expired",
                       f"Job '{job_id}' is {owner.status}; its trainer token no longer reports.")
    return owner


def accepts_reports(session: Session, job: Job, *, now: dt.datetime | None = None) -> bool:
    """Whether the job's token may still report: while the job runs, and for
    ``REPORT_GRACE_S`` after it stopped running (a trainer that was told to stop, or just
    exported its adapter, still flushes its last batch).

    After that the token is dead for good: a stolen or leaked token of a finished job
    cannot post events or overwrite ``error``. When the job runs again it gets a new token.
    """
    if job.status == "running" or job.awaiting_start_since is not None:
        return True  # (a trainer Kueue started reports before the scheduler has seen it run)
    changes = session.scalars(
        select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "status")
        .order_by(JobEvent.seq.desc()).limit(3)
    ).all()
    # The moment it left running: the last status change, or the one before a resume
    # (paused -> queued) that came while the stopped trainer was still checkpointing.
    left = next((c for c in changes if (c.data or {}).get("from") == "running"), None)
    if left is None or (changes[0] is not left and (changes[0].data or {}).get("to") not in ("queued", "paused")):
        return False
    # A run with no outcome yet may still be writing its final checkpoint: an executor
    # stops it only after its own poll (Kubernetes: once the Job is seen orphaned), and
    # the trainer then has its stop grace to checkpoint and report it.
    stopped = (job.exited_attempt or 0) >= (job.attempt or 0)
    grace = REPORT_GRACE_S if stopped else STOPPING_GRACE_S
    return (now or utcnow()) - left.created_at <= dt.timedelta(seconds=grace)


def _finite(value: float | None) -> float | None:
    """NaN/inf become None: JSON has no NaN, and a NaN loss arrives as an error item too."""
    return value if value is None or math.isfinite(value) else None


@dataclass(frozen=True)
class JobStorage:
    """Where a job's trainer writes (as the spec builder lays it out): the only places
    its token may register.

    ``outputs``: the job's ``output_dir`` in the artifact store (``<root>/<job>/output``).
    ``checkpoints``: ``<root>/<job>/checkpoints`` (S3, or a Kubernetes pod on a shared
    volume) and, for local trainers on a local store, ``<data>/jobs/<job>/checkpoints``.
    """

    outputs: tuple[str, ...]
    checkpoints: tuple[str, ...]


def job_storage(job_id: str, settings: Settings) -> JobStorage:
    root = settings.resolved_artifact_url
    if root.startswith("s3://"):
        base = root.rstrip("/")
        return JobStorage(outputs=(f"{base}/{job_id}/output",),
                          checkpoints=(f"{base}/{job_id}/checkpoints",))
    base_dir = resolved_dir(Path(root)) / job_id
    return JobStorage(
        outputs=(str(base_dir / "output"),),
        checkpoints=(str(base_dir / "checkpoints"), str(settings.job_dir(job_id) / "checkpoints")),
    )


def has_control_characters(text: str) -> bool:
    """C0 controls and DEL: never part of a path or key we write, and a NUL makes
    ``Path.resolve`` raise."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def is_inside(location: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``location`` is one of ``prefixes`` or lies below one.

    Local paths are resolved first (``..`` and symlinks cannot lead out); the prefixes are
    compared as written, so a symlink planted at a prefix cannot widen it. S3 keys are not
    normalized by the store, so the part below the prefix must be a clean relative key.
    """
    if has_control_characters(location):
        return False
    if location.startswith("s3://"):
        for prefix in (p for p in prefixes if p.startswith("s3://")):
            rest = location.removeprefix(prefix)
            if rest in ("", "/"):
                return True
            if rest.startswith("/") and _clean_key(rest[1:].rstrip("/")):
                return True
        return False
    if not os.path.isabs(location):
        return False
    path = os.path.realpath(location)
    return any(path == p or path.startswith(p.rstrip(os.sep) + os.sep)
               for p in prefixes if not p.startswith("s3://"))


def _clean_key(key: str) -> bool:
    return bool(key) and "\\" not in key and all(
        part not in ("", ".", "..") for part in key.split("/"))


def check_artifact_location(location: str, job_id: str, settings: Settings, *,
                            param: str = "items.location") -> None:
    """Refuse output locations outside the job's own output (400 ``invalid_artifact_location``).

    Artifacts are later served from their location with the API's own file access and S3
    credentials, so a job token (held by a trainer that reads tenant data) must not be
    able to register the data directory, another job's output or another bucket.
    """
    _check_location(location, job_storage(job_id, settings).outputs, "output", param)


def check_checkpoint_location(location: str, job_id: str, settings: Settings, *,
                              param: str = "items.location") -> None:
    """Refuse checkpoint locations outside the job's checkpoint directory (400)."""
    _check_location(location, job_storage(job_id, settings).checkpoints, "checkpoint", param)


def _check_location(location: str, prefixes: tuple[str, ...], kind: str, param: str) -> None:
    if has_control_characters(location):
        raise APIError(400, "invalid_artifact_location",
                       "Locations must not contain control characters.", param=param)
    if not is_inside(location, prefixes):
        raise APIError(400, "invalid_artifact_location",
                       f"Location '{location}' is outside this job's {kind} directory "
                       f"({' or '.join(prefixes)}).", param=param)


def check_batch_locations(job: Job, batch: ReportBatchIn, settings: Settings) -> None:
    """Every location and file name of ``batch`` is the job's own, or a 400 naming the item."""
    for index, item in enumerate(batch.items):
        if isinstance(item, ArtifactsItem):
            check_artifact_location(item.location, job.id, settings, param=f"items[{index}].location")
            for number, file in enumerate(item.files):
                try:
                    safe_key(file.name)
                except APIError as exc:
                    exc.param = f"items[{index}].files[{number}].name"
                    raise
        elif isinstance(item, CheckpointItem):
            check_checkpoint_location(item.location, job.id, settings, param=f"items[{index}].location")


def apply_report(session: Session, job: Job, batch: ReportBatchIn, settings: Settings) -> bool:
    """Apply ``batch`` to ``job`` and commit; returns False when it was a duplicate."""
    check_batch_locations(job, batch, settings)
    if session.scalar(
        select(ReportBatch.id).where(ReportBatch.job_id == job.id, ReportBatch.seq == batch.seq)
    ) is not None:
        return False
    session.add(ReportBatch(job_id=job.id, seq=batch.seq, n_items=len(batch.items)))
    if job.awaiting_start_since is not None:  # Kueue started it: the first report says so
        start_admitted_launch(session, lock_job(session, job.id) or job, actor="trainer")
    for item in batch.items:
        if isinstance(item, MetricItem):
            replaced = _apply_metric(session, job, item)
            if not replaced and (announced := metrics_event(item)) is not None:
                add_event(session, job, announced[0], type="metrics", data=announced[1])
        elif isinstance(item, EventItem):
            add_event(session, job, item.message, level=TRAINER_EVENT_LEVELS[item.level], type="message",
                      data=item.data)
        elif isinstance(item, CheckpointItem):
            _apply_checkpoint(session, job, item)
        elif isinstance(item, ArtifactsItem):
            apply_artifacts(session, job, item)
        elif isinstance(item, ErrorItem):
            job.error = {"code": item.code, "message": item.message, "param": None}
            add_event(session, job, f"{item.code}: {item.message}", level="error", type="message",
                      data={"code": item.code})
    try:
        session.commit()
    except IntegrityError:
        # A concurrent retry of the same batch committed first: this one is the duplicate.
        session.rollback()
        return False
    return True


def _apply_metric(session: Session, job: Job, item: MetricItem) -> bool:
    """Store the step's metrics; True when they replaced a row of the same step (whose
    event, if announced, was written already)."""
    values: dict[str, Any] = item.model_dump(exclude={"type"})
    for name in ("train_loss", "valid_loss", "grad_norm", *PREFERENCE_METRICS.values()):
        values[name] = _finite(values[name])
    # A trainer restarted from a checkpoint reports the steps after it again: the newest wins.
    replaced = session.execute(
        delete(JobMetric).where(JobMetric.job_id == job.id, JobMetric.step == item.step)).rowcount
    session.add(JobMetric(job_id=job.id, **values))
    if job.current_step is None or item.step >= job.current_step:
        job.current_step = item.step
        if item.total_steps:
            job.total_steps = item.total_steps
        if item.tokens_seen is not None:
            job.trained_tokens = item.tokens_seen
        job.estimated_finish = _estimated_finish(job)
    return bool(replaced)


def metrics_event(item: MetricItem) -> tuple[str, dict[str, Any]] | None:
    """The message and data of the ``metrics`` event announcing ``item``'s step, as OpenAI
    writes them (``"Step 3/10: training loss=1.2345"``, ``data`` with ``step``,
    ``train_loss``, ``train_mean_token_accuracy``, ...), or None for a step not announced.

    Announced: the first and the last step, every step with validation metrics, and evenly
    spaced steps between, at most ``METRIC_EVENTS_PER_RUN`` of those, so a long run's
    events stay readable; every step's metrics are in ``/metrics`` and the results file.
    """
    total = item.total_steps
    every = -(-total // METRIC_EVENTS_PER_RUN) if total else 1
    evaluated = item.valid_loss is not None or item.valid_token_accuracy is not None
    if not (item.step <= 1 or item.step == total or item.step % every == 0 or evaluated):
        return None
    values = item.model_dump(by_alias=True)
    data: dict[str, Any] = {"step": item.step}
    for public, value in (
        ("train_loss", _finite(item.train_loss)),
        ("train_mean_token_accuracy", item.token_accuracy),
        ("valid_loss", _finite(item.valid_loss)),
        ("valid_mean_token_accuracy", item.valid_token_accuracy),
        *((name, _finite(values[name])) for name in PREFERENCE_METRICS),
    ):
        if value is not None:
            data[public] = value
    data["total_steps"] = total
    message = f"Step {item.step}/{total}" if total else f"Step {item.step}"
    losses = [f"{label}={data[name]:.4f}" for name, label in (
        ("train_loss", "training loss"), ("valid_loss", "validation loss")) if name in data]
    return (f"{message}: {', '.join(losses)}" if losses else message), data


def _estimated_finish(job: Job) -> dt.datetime | None:
    """Linear ETA from the steps done since the job (re)started running."""
    if not (job.started_at and job.total_steps and job.current_step):
        return None
    elapsed = (utcnow() - job.started_at).total_seconds()
    remaining = max(0, job.total_steps - job.current_step)
    return utcnow() + dt.timedelta(seconds=elapsed / job.current_step * remaining)


def _apply_checkpoint(session: Session, job: Job, item: CheckpointItem) -> None:
    metrics: dict[str, float | None] = {"step": float(item.step)}
    for name, value in item.metrics.items():
        public = CHECKPOINT_METRIC_NAMES.get(name)
        if public is not None:
            metrics[public] = _finite(value)
    existing = session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == item.step)
    )
    if existing is not None:
        relisted = existing.location == item.location  # a resumed run lists its checkpoint again
        existing.location, existing.metrics = item.location, metrics
        if relisted:
            return
    else:
        session.add(Checkpoint(id=new_id("ftckpt"), job_id=job.id, step=item.step,
                               location=item.location, metrics=metrics))
    add_event(session, job, f"Checkpoint created at step {item.step}", type="message",
              data={"step": item.step, "checkpoint": checkpoint_model_id(job, item.step)})


def apply_artifacts(session: Session, job: Job, item: ArtifactsItem) -> None:
    """Record a job's output files (from a report, or from the manifest by the executor).

    Idempotent: the executor registers the manifest again in case the trainer's last report
    was lost, and the job's events say "Uploaded" only for files that changed.
    """
    changed: list[str] = []
    for file in item.files:
        row = session.scalar(
            select(Artifact).where(Artifact.job_id == job.id, Artifact.name == file.name)
        )
        if row is None:
            session.add(Artifact(job_id=job.id, name=file.name, bytes=file.bytes,
                                 sha256=file.sha256, location=item.location))
        elif (row.bytes, row.sha256, row.location) == (file.bytes, file.sha256, item.location):
            continue
        else:
            row.bytes, row.sha256, row.location = file.bytes, file.sha256, item.location
        changed.append(file.name)
    if any(f.name == ADAPTER_WEIGHTS for f in item.files):
        job.fine_tuned_model = fine_tuned_model_id(job)
    if changed:
        add_event(session, job, f"Uploaded {len(changed)} output file(s)", type="message",
                  data={"location": item.location, "files": changed})


def apply_recovered(session: Session, job: Job, items: list[MetricItem | CheckpointItem]) -> None:
    """Apply metric and checkpoint items read back from the trainer's outputs (the outcome
    path's reconciliation, ``worker.report_gaps``), as a report would have, without a batch."""
    for item in items:
        if isinstance(item, MetricItem):
            _apply_metric(session, job, item)
        else:
            _apply_checkpoint(session, job, item)
