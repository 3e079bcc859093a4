"""Schemas of what a job produces: metric rows and output files (``api/outputs/routes.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from control.db.models import Export
from control.exports import artifacts_prefix
from control.reports.schemas import PreferenceMetrics, ReinforcementMetrics


class MetricPublic(PreferenceMetrics, ReinforcementMetrics):
    """One metric row; a DPO run's also carries ``rewards/...``, a reinforcement run's
    ``reward_mean``, ``reward_std``, ``kl``, ``clip_fraction``, ``completion_length``,
    ``valid_reward_mean``, ``sub_rewards`` (a multi grader's sub-graders' mean rewards by
    name) and ``grader_errors`` (completions the grader could not score) (null otherwise)."""

    object: Literal["fine_tuning.job.metric"] = "fine_tuning.job.metric"
    step: int
    total_steps: int | None
    epoch: float | None
    train_loss: float | None
    valid_loss: float | None
    token_accuracy: float | None
    valid_token_accuracy: float | None
    learning_rate: float | None
    grad_norm: float | None
    tokens_per_s: float | None
    mfu: float | None = Field(
        None, description="Model FLOP utilisation of the step, a fraction (0.42 = 42 %): tokens_per_s x the "
        "model's FLOPs per token (no recomputation counted) / the gang's peak FLOP/s. Null when the "
        "step has no tokens_per_s or the job no throughput basis (admitted before it existed)."
    )
    tokens_seen: int | None
    memory_bytes: int | None
    time: float | None


class MetricsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[MetricPublic]
    has_more: bool
    last_step: int | None = Field(description="The cursor for the next page (``after``).")


class ArtifactPublic(BaseModel):
    object: Literal["fine_tuning.job.artifact"] = "fine_tuning.job.artifact"
    name: str
    bytes: int
    sha256: str


class ArtifactsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[ArtifactPublic]
    has_more: bool = False


class ExportCreate(BaseModel):
    """``POST /v1/fine_tuning/jobs/{id}/exports``: what to export."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["merged"] = Field(description="merged: the adapter folded into the base (HF safetensors).")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    checkpoint: str | None = Field(None, description="A checkpoint id of the job; default: its final adapter.")


class ExportPublic(BaseModel):
    object: Literal["fine_tuning.job.export"] = "fine_tuning.job.export"
    id: str
    fine_tuning_job_id: str
    format: Literal["merged"]
    dtype: str
    checkpoint: str | None
    status: Literal["queued", "running", "succeeded", "failed"] = "queued"
    artifacts_prefix: str = Field(description="Where its files appear in the job's artifacts once ready.")

    @classmethod
    def of(cls, row: Export) -> ExportPublic:
        return cls(id=row.id, fine_tuning_job_id=row.job_id, format="merged", dtype=row.dtype,
                   checkpoint=row.checkpoint_id, status=row.status, artifacts_prefix=artifacts_prefix(row.id))
