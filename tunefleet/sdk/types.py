"""Typed objects the service returns.

Shapes follow OpenAI's fine-tuning API (``file``, ``fine_tuning.job``,
``fine_tuning.job.event``, ``fine_tuning.job.checkpoint``) plus tunefleet's
extensions. Every model accepts unknown fields (``extra="allow"``) so an SDK older than
the service keeps working and extension fields stay reachable as attributes; only the
fields every response carries are required.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr

TERMINAL_JOB_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


class APIObject(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict including extension fields."""
        return self.model_dump(mode="json", exclude_none=False)


class FileValidationError(APIObject):
    line: int | None = None
    code: str | None = None
    message: str | None = None


class FileObject(APIObject):
    id: str
    object: Literal["file"] = "file"
    bytes: int | None = None
    created_at: int | None = None
    filename: str | None = None
    purpose: str | None = None
    status: str | None = None
    status_details: str | None = None

    @property
    def is_final(self) -> bool:
        """True once validation decided (``processed`` or ``error``)."""
        return self.status in ("processed", "error")

    def validation_errors(self) -> list[FileValidationError]:
        """Line-numbered problems found by validation, wherever the service put them."""
        extra = self.model_extra or {}
        candidates: Any = extra.get("errors")
        validation = extra.get("validation")
        if candidates is None and isinstance(validation, dict):
            candidates = validation.get("errors")
        if not isinstance(candidates, list):
            return []
        return [FileValidationError.model_validate(e) for e in candidates if isinstance(e, dict)]


class DeletedObject(APIObject):
    id: str
    object: str | None = None
    deleted: bool


class JobError(APIObject):
    code: str | None = None
    message: str | None = None
    param: str | None = None


class FineTuningJob(APIObject):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int | None = None
    model: str | None = None
    status: str
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    error: JobError | None = None
    hyperparameters: dict[str, Any] | None = None
    training_file: str | None = None
    validation_file: str | None = None
    result_files: list[str] = []
    trained_tokens: int | None = None
    seed: int | None = None
    estimated_finish: int | None = None
    metadata: dict[str, str] | None = None
    organization_id: str | None = None
    integrations: list[dict[str, Any]] | None = None

    # The resource that fetched this job, so ``job.wait()`` / ``job.refresh()`` work.
    _jobs: Any = PrivateAttr(default=None)

    @classmethod
    def bound(cls, data: Any, jobs: Any) -> FineTuningJob:
        """``data`` parsed as a job whose ``wait`` and ``refresh`` go through ``jobs``
        (the sync or async jobs resource that fetched it)."""
        job = cls.model_validate(data)
        job._jobs = jobs
        return job

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_JOB_STATUSES

    def wait(self, timeout: float | None = None, poll_interval: float = 1.0) -> Any:
        """Wait until the job ends; returns the final job (a coroutine on the async client)."""
        if self._jobs is None:
            raise RuntimeError("this job object is not bound to a client; use client.jobs.wait(id)")
        return self._jobs.wait(self.id, timeout=timeout, poll_interval=poll_interval)

    def refresh(self) -> Any:
        """Fetch the job again (a coroutine on the async client)."""
        if self._jobs is None:
            raise RuntimeError("this job object is not bound to a client; use client.jobs.retrieve(id)")
        return self._jobs.retrieve(self.id)


class JobEvent(APIObject):
    id: str
    object: str = "fine_tuning.job.event"
    created_at: int | None = None
    level: str | None = None
    message: str | None = None
    type: str | None = None
    data: Any = None


class JobCheckpoint(APIObject):
    id: str
    object: str = "fine_tuning.job.checkpoint"
    created_at: int | None = None
    fine_tuning_job_id: str | None = None
    fine_tuned_model_checkpoint: str | None = None
    step_number: int | None = None
    metrics: dict[str, Any] | None = None


class JobMetric(APIObject):
    """One training-step row of ``GET /v1/fine_tuning/jobs/{id}/metrics``."""

    step: int
    total_steps: int | None = None
    epoch: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    tokens_seen: int | None = None
    token_accuracy: float | None = None
    memory_bytes: int | None = None
    time: float | None = None


class ModelScore(APIObject):
    model: str
    score: float
    count: int
    errors: int = 0


class Evaluation(APIObject):
    """A held-out evaluation of a job (``fine_tuning.job.evaluation``): both models' scores
    in ``results`` (``base``, ``fine_tuned``) once it has succeeded."""

    id: str
    object: str = "fine_tuning.job.evaluation"
    fine_tuning_job_id: str | None = None
    file: str | None = None
    grader: dict[str, Any] | None = None
    max_samples: int | None = None
    status: str
    created_at: int | None = None
    finished_at: int | None = None
    progress: dict[str, int] | None = None
    error: JobError | None = None
    results: dict[str, ModelScore] | None = None
    samples: list[dict[str, Any]] = []

    @property
    def is_final(self) -> bool:
        """True once it has ``succeeded`` or ``failed``."""
        return self.status in ("succeeded", "failed")


class Artifact(APIObject):
    name: str
    bytes: int | None = None
    sha256: str | None = None


class Estimate(APIObject):
    """Dry run of placement: memory per GPU, chosen pool and GPU count, speed, ETA, cost."""


class NodePool(APIObject):
    name: str


class Model(APIObject):
    id: str
    object: str = "model"
    created: int | None = None
    owned_by: str | None = None


class WebhookEndpoint(APIObject):
    id: str
    object: str = "webhook_endpoint"
    url: str
    events: list[str] = []
    enabled: bool = True
    description: str | None = None
    created_at: int | None = None
    secret: str | None = None  # only in the create/rotate answers


class WebhookDelivery(APIObject):
    id: str
    object: str = "webhook_delivery"
    endpoint_id: str | None = None
    event_id: str | None = None
    event_type: str | None = None
    status: str | None = None
    attempts: int = 0
    response_status: int | None = None
    last_error: str | None = None


class StreamEvent(APIObject):
    """One Server-Sent Event of ``GET /v1/fine_tuning/jobs/{id}/stream``.

    ``event`` is the SSE event name (e.g. ``"event"``, ``"metric"``, ``"status"``,
    ``"checkpoint"``, ``"end"``); ``data`` is its decoded JSON payload.
    """

    event: str
    data: Any = None
    id: str | None = None
