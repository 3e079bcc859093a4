"""The trainer report protocol (docs/internals.md, "Trainer reports")."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from trainers.common.reinforcement import MAX_SUB_REWARD_NAME, MAX_SUB_REWARDS

Finite = Annotated[float, Field(allow_inf_nan=True)]

# Event data is free-form JSON from the trainer; it is stored with the event and shown to
# the tenant, so one item may not grow without bound.
MAX_EVENT_DATA_BYTES = 16 * 1024


def _small_json(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None and len(json.dumps(value, default=str)) > MAX_EVENT_DATA_BYTES:
        raise ValueError(f"event data must be at most {MAX_EVENT_DATA_BYTES} bytes as JSON")
    return value


class _Item(BaseModel):
    # Trainers may send fields newer than this service: keep the known ones, ignore the rest.
    model_config = ConfigDict(extra="ignore")


Step = Annotated[int, Field(ge=0, le=2**31 - 1)]
Count = Annotated[int, Field(ge=0, le=2**62)]

# A DPO run's metrics, under the names TRL and the trainers report them (``rewards/...``,
# ``valid_rewards/...`` on the validation set), and the field (and column) each is stored in.
PREFERENCE_METRICS: dict[str, str] = {
    f"{prefix}rewards/{name}": f"{prefix}rewards_{name}"
    for prefix in ("", "valid_")
    for name in ("chosen", "rejected", "accuracy", "margin")
}


class PreferenceMetrics(BaseModel):
    """A DPO run's reward metrics: read and written under their reported names
    (``PREFERENCE_METRICS``), held in the fields of the same name with ``_``."""

    rewards_chosen: Finite | None = Field(None, alias="rewards/chosen")
    rewards_rejected: Finite | None = Field(None, alias="rewards/rejected")
    rewards_accuracy: Finite | None = Field(None, alias="rewards/accuracy")
    rewards_margin: Finite | None = Field(None, alias="rewards/margin")
    valid_rewards_chosen: Finite | None = Field(None, alias="valid_rewards/chosen")
    valid_rewards_rejected: Finite | None = Field(None, alias="valid_rewards/rejected")
    valid_rewards_accuracy: Finite | None = Field(None, alias="valid_rewards/accuracy")
    valid_rewards_margin: Finite | None = Field(None, alias="valid_rewards/margin")


# A reinforcement run's metrics (``trainers.common.reinforcement``): reported, stored and shown
# under the same names.
REINFORCEMENT_METRICS: dict[str, str] = {
    name: name for name in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length",
                            "valid_reward_mean")
}
# Every method's own metrics, reported name -> field (and column).
METHOD_METRICS: dict[str, str] = {**PREFERENCE_METRICS, **REINFORCEMENT_METRICS}
# What a reinforcement step's grading adds (``trainers.common.reinforcement.GRADING_KEYS``):
# no single float each, so apart from ``METHOD_METRICS`` (which a checkpoint may record).
GRADING_METRICS = ("sub_rewards", "grader_errors")

# A multi grader's sub-grader name and its mean reward over a step. The trainer is untrusted:
# the names are bounded in number and length, and a reward that is not finite is refused
# (the trainer reports one it could not average as null).
SubRewardName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SUB_REWARD_NAME)]
SubRewards = Annotated[dict[SubRewardName, Annotated[float, Field(allow_inf_nan=False)] | None],
                       Field(max_length=MAX_SUB_REWARDS)]


class ReinforcementMetrics(BaseModel):
    """A reinforcement run's metrics: the mean and std of its sampled completions' rewards,
    the mean per-token KL to the reference (null with ``kl_coef`` 0), the fraction of
    completion tokens whose ratio was clipped, the mean completion length in tokens, and at
    evaluations the mean reward on the validation prompts. Besides, what the step's grading
    said: a ``multi`` grader's sub-graders' mean rewards by name (``sub_rewards``, null for
    any other grader) and how many completions the grader could not score
    (``grader_errors``; each got reward 0)."""

    reward_mean: Finite | None = None
    reward_std: Finite | None = None
    kl: Finite | None = None
    clip_fraction: Finite | None = None
    completion_length: Finite | None = None
    valid_reward_mean: Finite | None = None
    sub_rewards: SubRewards | None = None
    grader_errors: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None


class MetricItem(_Item, PreferenceMetrics, ReinforcementMetrics):
    type: Literal["metric"]
    step: Step
    total_steps: Step | None = None
    epoch: float | None = None
    train_loss: Finite | None = None
    valid_loss: Finite | None = None
    token_accuracy: float | None = None
    valid_token_accuracy: float | None = None
    learning_rate: float | None = None
    grad_norm: Finite | None = None
    tokens_per_s: float | None = None
    tokens_seen: Count | None = None
    memory_bytes: Count | None = None
    time: float | None = None


class EventItem(_Item):
    type: Literal["event"]
    level: Literal["debug", "info", "warn", "warning", "error"] = "info"
    message: Annotated[str, Field(max_length=4000)]
    data: Annotated[dict[str, Any] | None, AfterValidator(_small_json)] = None


class CheckpointItem(_Item):
    type: Literal["checkpoint"]
    step: Step
    location: Annotated[str, Field(min_length=1, max_length=1024)]
    metrics: dict[str, float | None] = Field(default_factory=dict, max_length=100)


class ArtifactFile(_Item):
    name: Annotated[str, Field(min_length=1, max_length=1024)]
    bytes: Count
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ArtifactsItem(_Item):
    type: Literal["artifacts"]
    location: Annotated[str, Field(min_length=1, max_length=1024)]
    files: Annotated[list[ArtifactFile], Field(max_length=10_000)]


class ErrorItem(_Item):
    type: Literal["error"]
    code: Annotated[str, Field(min_length=1, max_length=100)]
    message: Annotated[str, Field(max_length=4000)]


ReportItem = Annotated[
    MetricItem | EventItem | CheckpointItem | ArtifactsItem | ErrorItem,
    Field(discriminator="type"),
]


class ReportBatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq: Count
    items: Annotated[list[ReportItem], Field(max_length=10_000)]


class ReportAck(BaseModel):
    acked_seq: int
    duplicate: bool
