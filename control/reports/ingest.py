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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control.artifacts import safe_key
from control.db.base import utcnow
from control.db.models import Artifact, Checkpoint, Job, JobEvent, JobMetric, ReportBatch
from control.errors import APIError
from control.ids import hash_secret, new_id
from control.jobs.lifecycle import add_event, lock_job, start_admitted_launch
from control.jobs.naming import checkpoint_model_id, fine_tuned_model_id
from control.reports.schemas import (
    GRADING_METRICS,
    METHOD_METRICS,
    ArtifactsItem,
    CheckpointItem,
    ErrorItem,
    EventItem,
    MetricItem,
    ReportBatchIn,
)
from control.settings import Settings, resolved_dir
from scheduling.throughput import row_mfu

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
    **{name: name for name in METHOD_METRICS},
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


def check_report_size(batch: ReportBatchIn, body_bytes: int, settings: Settings) -> None:
    """413 ``report_too_large`` for a report over ``report_max_items`` or ``report_max_bytes``."""
    if len(batch.items) > settings.report_max_items:
        raise APIError(413, "report_too_large",
                       f"A report holds at most {settings.report_max_items} items; this one has "
                       f"{len(batch.items)}. Send them in several reports.", param="items")
    if body_bytes > settings.report_max_bytes:
        raise APIError(413, "report_too_large",
                       f"A report's body is at most {settings.report_max_bytes} bytes; this one has "
                       f"{body_bytes}. Send its items in several reports.")


def apply_report(session: Session, job: Job, batch: ReportBatchIn, settings: Settings) -> bool:
    """Apply ``batch`` to ``job``, committing every ``REPORT_CHUNK_ITEMS`` items; returns
    False when it was a duplicate.

    The batch's row records how many of its items are applied, and each transaction moves
    that count on (only from the value it read, so two concurrent retries never apply an
    item twice): a retry after a crash between two transactions applies the rest. Bounded
    transactions keep a big report from holding SQLite's write lock (the whole database)
    or a job's row for longer than one chunk takes.
    """
    check_batch_locations(job, batch, settings)
    row_id, applied = _claim_batch(session, job, batch)
    if applied >= len(batch.items) and row_id is None:
        return False
    quota = _Quota(settings.report_max_items_per_job, settings.report_max_bytes_per_job)
    while applied < len(batch.items):
        end = min(len(batch.items), applied + REPORT_CHUNK_ITEMS)
        locked = lock_job(session, job.id)
        if locked is None:  # the job was deleted meanwhile
            session.rollback()
            return False
        if not _advance(session, row_id, applied, end):
            session.rollback()  # a concurrent retry applied this chunk: go on after its progress
            applied = session.scalar(select(ReportBatch.applied_items).where(ReportBatch.id == row_id)) or 0
            session.rollback()
            continue
        began = time.monotonic()
        _apply_items(session, locked, batch.items[applied:end], quota)
        session.commit()
        applied = end
        if applied < len(batch.items):
            _let_other_writers_in(session, time.monotonic() - began)
    return True


# Items applied per transaction (see apply_report).
REPORT_CHUNK_ITEMS = 100
MAX_CHUNK_PAUSE_S = 0.1


def _let_other_writers_in(session: Session, chunk_s: float) -> None:
    """On SQLite, pause between two chunks for as long as the last one held the write lock.

    A writer waiting for SQLite's lock retries on a back-off of up to 100 ms; a report that
    takes the lock again at once would win every time and starve it for the whole batch.
    PostgreSQL locks rows, and other tenants' rows are never this report's.
    """
    if session.get_bind().dialect.name == "sqlite":
        time.sleep(min(chunk_s, MAX_CHUNK_PAUSE_S))


def _claim_batch(session: Session, job: Job, batch: ReportBatchIn) -> tuple[int | None, int]:
    """The batch's row id and how many of its items are applied; (None, n) for a batch
    applied whole before (a duplicate). The first transaction of a new batch records it
    (and, for a job Kueue started, the trainer's start)."""
    if job.awaiting_start_since is not None:  # Kueue started it: the first report says so
        start_admitted_launch(session, lock_job(session, job.id) or job, actor="trainer")
    row = ReportBatch(job_id=job.id, seq=batch.seq, n_items=len(batch.items), applied_items=0)
    session.add(row)
    try:
        session.commit()
        return row.id, 0
    except IntegrityError:
        session.rollback()  # this seq was seen before (a retry): applied whole, or partly
    existing = session.execute(
        select(ReportBatch.id, ReportBatch.applied_items, ReportBatch.n_items)
        .where(ReportBatch.job_id == job.id, ReportBatch.seq == batch.seq)
    ).one()
    session.rollback()
    if existing.applied_items >= existing.n_items:
        return None, existing.n_items
    return existing.id, existing.applied_items


def _advance(session: Session, row_id: int | None, applied: int, end: int) -> bool:
    """Move the batch's progress from ``applied`` to ``end``; False if it is not at ``applied``."""
    moved = session.execute(
        update(ReportBatch).where(ReportBatch.id == row_id, ReportBatch.applied_items == applied)
        .values(applied_items=end)
    )
    return moved.rowcount == 1


@dataclass
class _Quota:
    """How many metric and event items (and bytes of them) a job's reports may store."""

    max_items: int
    max_bytes: int

    def admits(self, session: Session, job: Job, size: int) -> bool:
        """Count an item of ``size`` bytes against ``job``'s quota; False (dropped) past it.

        The first dropped item leaves one warning event, so the tenant learns why later
        metrics and events are missing."""
        if job.report_items + 1 <= self.max_items and job.report_bytes + size <= self.max_bytes:
            job.report_items += 1
            job.report_bytes += size
            return True
        if not job.report_items_dropped:
            add_event(session, job, f"The trainer's reports reached this job's quota ({self.max_items} items, "
                      f"{self.max_bytes} bytes of metrics and events): later metrics and events are not stored; "
                      "checkpoints, output files and errors still are.", level="warn", type="message",
                      data={"code": "report_quota_exceeded"})
        job.report_items_dropped += 1
        return False


def _apply_items(session: Session, job: Job, items: list[Any], quota: _Quota) -> None:
    """Apply ``items`` to the locked ``job`` in the current transaction.

    Once the job has an outcome (succeeded, failed, cancelled) nothing a late report says
    changes it: metrics and events are still stored (a trainer's last flush may arrive
    just after its exit was seen) but leave the job's fields alone, and output files and
    errors are not applied (an event records a late error).
    """
    metrics: dict[int, dict[str, Any]] = {}  # step -> row values; a step reported twice: the last wins
    announced_before = _stored_steps(session, job, items)  # a step's metrics event is written once
    for item in items:
        if isinstance(item, MetricItem | EventItem) and not quota.admits(session, job, _item_bytes(item)):
            continue
        if isinstance(item, MetricItem):
            metrics[item.step] = _metric_values(job, item)
            if item.step not in announced_before and (announced := metrics_event(item)) is not None:
                add_event(session, job, announced[0], type="metrics", data=announced[1])
            announced_before.add(item.step)
        elif isinstance(item, EventItem):
            add_event(session, job, item.message, level=TRAINER_EVENT_LEVELS[item.level], type="message",
                      data=item.data)
        elif isinstance(item, CheckpointItem):
            _apply_checkpoint(session, job, item)
        elif isinstance(item, ArtifactsItem) and not job.is_terminal:
            apply_artifacts(session, job, item)
        elif isinstance(item, ErrorItem):
            _apply_error(session, job, item)
    _store_metrics(session, job, metrics)


def _stored_steps(session: Session, job: Job, items: list[Any]) -> set[int]:
    """The steps of ``items``' metrics that the job has a row for already."""
    steps = {item.step for item in items if isinstance(item, MetricItem)}
    if not steps:
        return set()
    return set(session.scalars(select(JobMetric.step).where(JobMetric.job_id == job.id, JobMetric.step.in_(steps))))


def _store_metrics(session: Session, job: Job, metrics: dict[int, dict[str, Any]]) -> None:
    if metrics:
        # A trainer restarted from a checkpoint reports the steps after it again: the newest wins.
        session.execute(delete(JobMetric).where(JobMetric.job_id == job.id, JobMetric.step.in_(metrics)))
        session.execute(insert(JobMetric), list(metrics.values()))
        _refresh_means(session, job)


def _refresh_means(session: Session, job: Job) -> None:
    """The job's ``mean_tokens_per_s`` and ``mean_mfu`` over its stored rows (AVG skips the
    rows without a value). Recomputed rather than kept as running sums, because a step
    reported again replaces its row; late rows of a finished job count too, as they are
    shown in its metrics."""
    mean_tps, mean_mfu = session.execute(
        select(func.avg(JobMetric.tokens_per_s), func.avg(JobMetric.mfu)).where(JobMetric.job_id == job.id)
    ).one()
    job.mean_tokens_per_s = None if mean_tps is None else float(mean_tps)
    job.mean_mfu = None if mean_mfu is None else float(mean_mfu)


def _item_bytes(item: MetricItem | EventItem) -> int:
    return len(item.model_dump_json(by_alias=True))


def _apply_error(session: Session, job: Job, item: ErrorItem) -> None:
    if job.is_terminal:
        add_event(session, job, f"The trainer reported {item.code}: {item.message} after the job {job.status}; "
                  "the job's outcome stays as it is.", level="warn", type="message",
                  data={"code": item.code, "ignored": True})
        return
    job.error = {"code": item.code, "message": item.message, "param": None}
    add_event(session, job, f"{item.code}: {item.message}", level="error", type="message",
              data={"code": item.code})


def _metric_values(job: Job, item: MetricItem) -> dict[str, Any]:
    """The metric row's values; the running job's progress fields follow the newest step."""
    values: dict[str, Any] = item.model_dump(exclude={"type"})
    # tokens_per_s too: the job's mean of it must stay a JSON number.
    for name in ("train_loss", "valid_loss", "grad_norm", "tokens_per_s", *METHOD_METRICS.values()):
        values[name] = _finite(values[name])
    # The step's MFU on the gang the job was admitted to (None before that basis existed).
    values["mfu"] = row_mfu(values["tokens_per_s"], job.estimate)
    if not job.is_terminal and (job.current_step is None or item.step >= job.current_step):
        job.current_step = item.step
        if item.total_steps:
            job.total_steps = item.total_steps
        if item.tokens_seen is not None:
            job.trained_tokens = item.tokens_seen
        job.estimated_finish = _estimated_finish(job)
    return {"job_id": job.id, **values}


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
    evaluated = any(v is not None for v in (item.valid_loss, item.valid_token_accuracy, item.valid_reward_mean))
    if not (item.step <= 1 or item.step == total or item.step % every == 0 or evaluated):
        return None
    values = item.model_dump(by_alias=True)
    data: dict[str, Any] = {"step": item.step}
    for public, value in (
        ("train_loss", _finite(item.train_loss)),
        ("train_mean_token_accuracy", item.token_accuracy),
        ("valid_loss", _finite(item.valid_loss)),
        ("valid_mean_token_accuracy", item.valid_token_accuracy),
        *((name, _finite(values[name])) for name in METHOD_METRICS),
    ):
        if value is not None:
            data[public] = value
    data.update({name: values[name] for name in GRADING_METRICS if values[name] is not None})
    data["total_steps"] = total
    message = f"Step {item.step}/{total}" if total else f"Step {item.step}"
    losses = [f"{label}={data[name]:.4f}" for name, label in (
        ("train_loss", "training loss"), ("valid_loss", "validation loss"), ("reward_mean", "mean reward"),
        ("valid_reward_mean", "validation reward")) if name in data]
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
    _store_metrics(session, job, {item.step: _metric_values(job, item) for item in items
                                  if isinstance(item, MetricItem)})
    for item in items:
        if isinstance(item, CheckpointItem):
            _apply_checkpoint(session, job, item)
