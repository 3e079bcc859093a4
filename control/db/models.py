"""The tables of the control plane as typed SQLAlchemy 2.0 models.

Tenants own API keys, files and jobs; a job owns its events, metric rows, checkpoints,
artifacts and applied report batches. Only ``control.jobs.lifecycle.transition`` writes
``Job.status``. JSON columns hold values already validated by the API schemas.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from control.db.base import Base, utcnow

# Job statuses (docs/internals.md). Terminal ones never change again.
JOB_STATUSES = ("validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
FILE_STATUSES = ("uploaded", "processed", "error")


class Tenant(Base):
    """An organization: the unit of isolation, quota and fair share."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    """An API key; only its sha256 and the displayable prefix are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")

    @property
    def grants_admin(self) -> bool:
        return self.is_admin or self.tenant.is_admin


class File(Base):
    """An uploaded training/validation file and its validation result."""

    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_files_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    purpose: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="uploaded")
    status_details: Mapped[str | None] = mapped_column(Text)
    validation: Mapped[dict[str, Any] | None]
    location: Mapped[str] = mapped_column(String(1024), doc="Artifact-store key of the content.")
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(
        doc="Set by the upload's expires_after; the expiry sweep deletes the file after it.")
    deleted_at: Mapped[dt.datetime | None]


UPLOAD_STATUSES = ("pending", "completed", "cancelled", "expired")


class Upload(Base):
    """OpenAI's ``upload``: a file sent in parts (``api/uploads``), a File once completed."""

    __tablename__ = "uploads"
    __table_args__ = (
        Index("ix_uploads_tenant_created", "tenant_id", "created_at"),
        Index("ix_uploads_status_expires", "status", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger, doc="Declared at creation; the parts must add up to it.")
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    file_expires_after_s: Mapped[int | None] = mapped_column(
        Integer, doc="The upload's expires_after.seconds: the completed File expires this long after it is made.")
    file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), doc="The File made at completion.")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(doc="A pending upload expires then; its parts are deleted.")


class UploadPart(Base):
    """OpenAI's ``upload.part``: one chunk of an upload's bytes, stored under ``uploads/<upload>/``."""

    __tablename__ = "upload_parts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    location: Mapped[str] = mapped_column(String(1024), doc="Key of the part in the file store.")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Job(Base):
    """A fine-tuning job: OpenAI's ``fine_tuning.job`` plus scheduling/trainer extensions."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_status_priority", "status", "priority", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(256), doc="As the job was created with it: a base model, or the "
                                       "fine-tuned model (``ft:...``) it continues from.")
    base_model: Mapped[str] = mapped_column(
        String(256), default=lambda context: context.get_current_parameters()["model"],
        doc="The base model of the registry the job trains on: ``model``, or for a job that continues a "
        "fine-tuned model the base at the root of its lineage (default: ``model``).")
    parent: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, doc="The fine-tuned model the job continues from (``control.job_settings.ParentSettings``); "
        "None: it trains from ``base_model``.")
    training_file: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    status: Mapped[str] = mapped_column(String(32))
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(JSON, doc="Resolved, no 'auto'.")
    method: Mapped[dict[str, Any]]
    adapter: Mapped[dict[str, Any]]
    trainer: Mapped[str] = mapped_column(String(32), default="auto")
    placement: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_seq_len: Mapped[int] = mapped_column(Integer)
    packing: Mapped[bool] = mapped_column(Boolean, default=False)
    eval: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(BigInteger)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    integrations: Mapped[list[Any]] = mapped_column(JSON, default=list)
    estimate: Mapped[dict[str, Any] | None]
    pool: Mapped[str | None] = mapped_column(String(128))
    gpus: Mapped[int | None] = mapped_column(Integer)
    queue_reason: Mapped[str | None] = mapped_column(Text)
    queue_position: Mapped[int | None] = mapped_column(
        Integer, doc="Place among the waiting jobs in the scheduler's last cycle (1 = next)."
    )
    error: Mapped[dict[str, Any] | None]
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512))
    result_files: Mapped[list[Any]] = mapped_column(JSON, default=list)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    current_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    estimated_finish: Mapped[dt.datetime | None]
    resume_from: Mapped[str | None] = mapped_column(String(1024))
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    retry_placement: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, doc="{pool, gpus} the scheduler retries the job with after it ran out of GPU memory "
        "on fewer GPUs (set by the executor, never by the user; ``placement`` is the user's)."
    )
    job_token_hash: Mapped[str | None] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(
        Integer, default=0, doc="Run attempt: 1 at the first admission, +1 at each later one. Every "
        "executor outcome names the attempt it belongs to; one of an older attempt never moves the job."
    )
    exited_attempt: Mapped[int] = mapped_column(
        Integer, default=0, doc="The newest attempt whose trainer is known to have stopped. A job "
        "whose ``attempt`` is newer is not admitted again until that run has stopped (or the "
        "scheduler's stop deadline passed), so two trainers never write one job's checkpoints."
    )
    restart_not_before: Mapped[dt.datetime | None] = mapped_column(
        doc="Set when a lost run is requeued (a restart): the scheduler admits the job again no "
        "earlier than this (the restart backoff, ``control.settings.Settings.restart_backoff_s``)."
    )
    awaiting_start_since: Mapped[dt.datetime | None] = mapped_column(
        doc="Set while the job is ``queued`` but admitted: its Kubernetes Job exists and waits for the "
        "cluster's own admission (Kueue) to start it. The next transition clears it (``control.jobs.lifecycle``): "
        "to ``running`` when the trainer starts, to anything else when it never did."
    )
    usage: Mapped[dict[str, Any] | None]
    report_gaps: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, doc="Set when a run ended with records its trainer's reports never delivered and its "
        "outputs (``metrics.jsonl``, checkpoint folders) could not supply either "
        "(``worker.report_gaps``): ``missing_metric_steps`` (ranges), ``missing_checkpoints``. "
        "None: complete."
    )
    mean_tokens_per_s: Mapped[float | None] = mapped_column(
        Float, doc="Mean ``tokens_per_s`` over the job's metric rows, refreshed whenever rows are stored."
    )
    mean_mfu: Mapped[float | None] = mapped_column(
        Float, doc="Mean ``mfu`` over the job's metric rows that have one (None: no row has one)."
    )
    report_items: Mapped[int] = mapped_column(
        BigInteger, default=0, doc="Metric and event items its trainers' reports stored (the job's "
        "report quota, ``Settings.report_max_items_per_job``)."
    )
    report_bytes: Mapped[int] = mapped_column(
        BigInteger, default=0, doc="Their size as JSON (``Settings.report_max_bytes_per_job``)."
    )
    report_items_dropped: Mapped[int] = mapped_column(
        BigInteger, default=0, doc="Metric and event items not stored because the quota was used up."
    )
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class JobListVersion(Base):
    """A tenant's job-change counter, bumped in every transaction that writes its jobs.

    Written only by ``control.db.job_versions``; read to validate cached job lists
    (``api.jobs.pages``). No row yet: the tenant's jobs were not written since it exists.
    """

    __tablename__ = "job_list_versions"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(BigInteger)


class JobEvent(Base):
    """A ``fine_tuning.job.event``; ``seq`` orders events (and is the SSE event id)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_seq", "job_id", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text)
    type: Mapped[str] = mapped_column(String(16), default="message")
    data: Mapped[dict[str, Any] | None]


class JobMetric(Base):
    """One metric row of the trainer report protocol; one row per (job, step)."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_metrics_job_step"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[float | None] = mapped_column(Float)
    train_loss: Mapped[float | None] = mapped_column(Float)
    valid_loss: Mapped[float | None] = mapped_column(Float)
    token_accuracy: Mapped[float | None] = mapped_column(Float)
    valid_token_accuracy: Mapped[float | None] = mapped_column(Float)
    learning_rate: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(
        Float, doc="Model FLOP utilisation of the step (a fraction), from ``tokens_per_s`` and the job's "
        "``estimate[\"throughput\"]`` at ingestion (``scheduling.throughput``); None without either."
    )
    tokens_seen: Mapped[int | None] = mapped_column(BigInteger)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    time: Mapped[float | None] = mapped_column(Float, doc="Unix seconds at the trainer.")
    # DPO runs only (reported as rewards/chosen, ..., valid_rewards/margin).
    rewards_chosen: Mapped[float | None] = mapped_column(Float)
    rewards_rejected: Mapped[float | None] = mapped_column(Float)
    rewards_accuracy: Mapped[float | None] = mapped_column(Float)
    rewards_margin: Mapped[float | None] = mapped_column(Float)
    valid_rewards_chosen: Mapped[float | None] = mapped_column(Float)
    valid_rewards_rejected: Mapped[float | None] = mapped_column(Float)
    valid_rewards_accuracy: Mapped[float | None] = mapped_column(Float)
    valid_rewards_margin: Mapped[float | None] = mapped_column(Float)
    # Reinforcement runs only (``control.reports.schemas.REINFORCEMENT_METRICS``).
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    kl: Mapped[float | None] = mapped_column(Float)
    clip_fraction: Mapped[float | None] = mapped_column(Float)
    completion_length: Mapped[float | None] = mapped_column(Float)
    valid_reward_mean: Mapped[float | None] = mapped_column(Float)
    sub_rewards: Mapped[dict[str, float | None] | None] = mapped_column(
        JSON, doc="A multi grader's sub-grader name -> its mean reward over the step's completions."
    )
    grader_errors: Mapped[int | None] = mapped_column(
        Integer, doc="The step's completions the grader could not score (each got reward 0)."
    )
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    """A ``fine_tuning.job.checkpoint`` registered by the trainer."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    location: Mapped[str] = mapped_column(String(1024))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Artifact(Base):
    """One output file of a job (adapter, config, metrics log, manifest)."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(1024), doc="Relative path inside the output dir.")
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    location: Mapped[str] = mapped_column(String(1024), doc="Output dir (path or s3:// URI).")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Export(Base):
    """A merged export of a job's adapter (final or a checkpoint's) into its base model.

    ``status``: ``queued`` (sent to a worker), ``running``, ``succeeded`` (its files are the
    job's artifacts under ``exports/<id>/``) or ``failed`` (the reason is a job event).
    """

    __tablename__ = "exports"
    __table_args__ = (
        Index("ix_exports_job", "job_id", "checkpoint_id"),
        Index("ix_exports_tenant_status", "tenant_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    checkpoint_id: Mapped[str | None] = mapped_column(String(64))
    dtype: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


EVALUATION_STATUSES = ("queued", "running", "succeeded", "failed")


class Evaluation(Base):
    """A held-out evaluation of a succeeded job: its base and fine-tuned models answer the
    rows of a file, graded by one grader (``api/evaluations``).

    ``status``: ``queued`` (waiting for an API process to run it), ``running`` (``runner``
    holds it and renews ``heartbeat_at``), ``succeeded`` (``results`` and ``samples``) or
    ``failed`` (``error``). A claim whose heartbeat stopped is taken over by another API
    process (``attempts`` counts the runs), so no evaluation stays ``running`` forever.
    """

    __tablename__ = "evaluations"
    __table_args__ = (
        Index("ix_evaluations_job_created", "job_id", "created_at", "id"),
        Index("ix_evaluations_tenant_status", "tenant_id", "status"),
        Index("ix_evaluations_status_heartbeat", "status", "heartbeat_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    file_id: Mapped[str] = mapped_column(String(64), doc="The evaluated file (no key: files expire).")
    grader: Mapped[dict[str, Any]] = mapped_column(JSON, doc="As checked, the default filled in.")
    max_samples: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    rows_done: Mapped[int] = mapped_column(Integer, default=0, doc="Answers generated, both models.")
    rows_total: Mapped[int] = mapped_column(Integer, default=0)
    results: Mapped[dict[str, Any] | None]
    samples: Mapped[list[Any] | None]
    error: Mapped[dict[str, Any] | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    runner: Mapped[str | None] = mapped_column(String(128), doc="The API process that holds it.")
    heartbeat_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]


class IdempotencyKey(Base):
    """``Idempotency-Key`` of a job creation: same key + same body -> same job."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("tenant_id", "key", name="uq_idempotency_keys_tenant_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ReportBatch(Base):
    """An applied trainer report batch; the unique (job_id, seq) makes retries harmless."""

    __tablename__ = "report_batches"
    __table_args__ = (UniqueConstraint("job_id", "seq", name="uq_report_batches_job_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    n_items: Mapped[int] = mapped_column(Integer)
    applied_items: Mapped[int] = mapped_column(
        Integer, default=0, doc="Items applied so far: a batch is written in bounded transactions, "
        "and a retry resumes after the last one that committed."
    )
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class PoolCapacity(Base):
    """A pool's nodes as the scheduler last observed them in the cluster (Kubernetes mode).

    The API does not talk to the cluster; the scheduler writes one row per pool each
    cycle it observes real Nodes, and ``GET /v1/node_pools`` shows it while it is fresh.
    """

    __tablename__ = "pool_capacity"

    pool: Mapped[str] = mapped_column(String(128), primary_key=True)
    nodes: Mapped[list[Any]] = mapped_column(JSON, doc="[{name, gpus_total, gpus_free}]")
    observed_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class RegisteredModel(Base):
    """A base model an admin registered through ``POST /v1/models`` (control/models/registry.py).

    It joins the YAML registry's entries once ``status`` is ``ready``; a Hub source is
    ``fetching`` until the worker has downloaded and checked it (``failed`` with ``error``).
    """

    __tablename__ = "registered_models"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    source: Mapped[str] = mapped_column(String(1024), doc="local path, s3:// URI or Hub id[@revision]")
    status: Mapped[str] = mapped_column(String(16), doc="ready | fetching | failed")
    path: Mapped[str | None] = mapped_column(String(1024), doc="the checkpoint trainers read")
    architecture: Mapped[str | None] = mapped_column(String(32))
    max_seq_len: Mapped[int | None] = mapped_column(Integer)
    params_b: Mapped[float | None] = mapped_column(Float)
    hf_id: Mapped[str | None] = mapped_column(String(256))
    revision: Mapped[str | None] = mapped_column(String(256), doc="Hub: the revision asked for")
    commit_sha: Mapped[str | None] = mapped_column(String(64), doc="Hub: the commit fetched")
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, doc="{code, message} when failed")
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class CheckpointPermission(Base):
    """OpenAI's ``checkpoint.permission``: another tenant (``project_id``) may use a model of
    ``job``: a checkpoint's (``step``) or, with no step, the job's fine-tuned model."""

    __tablename__ = "checkpoint_permissions"
    __table_args__ = (
        UniqueConstraint("model", "project_id", name="uq_checkpoint_permissions_model_project"),
        Index("ix_checkpoint_permissions_project", "project_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(600), doc="The shared model's name, as completions name it.")
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int | None] = mapped_column(Integer, doc="The checkpoint's step; None: the final model.")
    project_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
