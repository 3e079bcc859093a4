"""Held-out evaluation shapes: ``EvaluationCreate`` (the request), ``EvaluationPublic``
(``fine_tuning.job.evaluation``) and its list.

An evaluation has a score per model, ``results.base`` and ``results.fine_tuned``: the mean
of the grader's rewards over ``count`` rows (a row the model could not answer, or the
grader could not grade, counts 0 and is counted in ``errors``), and ``samples``: the
first rows' answers of both models side by side.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from api.schemas.common import AcceptWholeFloats, ListPublic, PublicObject, Strict
from control.db.base import to_unix
from control.db.models import Evaluation

# Exact match: the answer's text equals the row's reference (its last assistant turn).
DEFAULT_GRADER: dict[str, Any] = {"type": "string_check", "name": "exact_match", "operation": "eq",
                                  "input": "{{sample.output_text}}", "reference": "{{item.reference}}"}
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS = 1024


class EvaluationCreate(Strict):
    """``POST /v1/fine_tuning/jobs/{id}/evaluations``."""

    file: str | None = Field(None, max_length=64, description="A processed file of the job's organization: the "
                             "held-out rows; default: the job's validation file.")
    max_samples: Annotated[int, Field(strict=True, ge=1), AcceptWholeFloats] | None = Field(
        None, description="Rows to evaluate, from the top of the file; default: all of them, at most "
                          "TUNEFLEET_EVALUATION_MAX_SAMPLES (asking for more is 400 too_many_samples).")
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS), AcceptWholeFloats] = Field(
        DEFAULT_MAX_TOKENS, description="Longest answer, in tokens; a row whose prompt leaves less room in the "
                                        "model's context is not answered (an error of that row).")
    grader: dict[str, Any] | None = Field(
        None, description="A grader as reinforcement fine-tuning takes it (string_check, text_similarity, python, "
                          "score_model, multi); default: string_check eq of {{sample.output_text}} and "
                          "{{item.reference}}, exact match.")


class EvaluationProgress(PublicObject):
    answered: int = Field(description="Answers generated so far, both models.")
    total: int = Field(description="Answers the evaluation asks for: 2 per row.")


class ModelScore(PublicObject):
    model: str
    score: float = Field(description="Mean reward over the rows.")
    count: int
    errors: int = Field(description="Rows without an answer or a grade (reward 0).")


class EvaluationResults(PublicObject):
    base: ModelScore
    fine_tuned: ModelScore


class SampleAnswer(PublicObject):
    answer: str | None
    reward: float
    error: str | None = Field(description="Why the model has no answer, or the grader no grade.")


class EvaluationSample(PublicObject):
    line: int = Field(description="The row's line in the file.")
    prompt: str = Field(description="The prompt's last message.")
    reference: str | None
    base: SampleAnswer
    fine_tuned: SampleAnswer


class EvaluationPublic(PublicObject):
    object: Literal["fine_tuning.job.evaluation"] = "fine_tuning.job.evaluation"
    id: str
    fine_tuning_job_id: str
    file: str
    grader: dict[str, Any]
    max_samples: int
    max_tokens: int
    status: Literal["queued", "running", "succeeded", "failed"]
    created_at: int
    started_at: int | None
    finished_at: int | None
    progress: EvaluationProgress
    error: dict[str, Any] | None = Field(description="{code, message} of a failed evaluation.")
    results: EvaluationResults | None
    samples: list[EvaluationSample]

    @classmethod
    def of(cls, row: Evaluation) -> EvaluationPublic:
        return cls(id=row.id, fine_tuning_job_id=row.job_id, file=row.file_id, grader=row.grader,
                   max_samples=row.max_samples, max_tokens=row.max_tokens, status=row.status,  # type: ignore[arg-type]
                   created_at=to_unix(row.created_at) or 0, started_at=to_unix(row.started_at),
                   finished_at=to_unix(row.finished_at),
                   progress=EvaluationProgress(answered=row.rows_done, total=row.rows_total), error=row.error,
                   results=EvaluationResults.model_validate(row.results) if row.results else None,
                   samples=[EvaluationSample.model_validate(s) for s in row.samples or []])


EvaluationsPublic = ListPublic[EvaluationPublic]
