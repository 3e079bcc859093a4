"""The names of a job's models: ``ft:<base>:<org>[:<suffix>]:<job id>`` for the final
adapter and ``...:ckpt-step-<n>`` for each checkpoint.

``<base>`` is the base model the job trains on, also for a job that continues a fine-tuned
model (as OpenAI names a model fine-tuned from a fine-tuned one after the base).

In the name every character of the user's ``suffix`` other than a letter, digit, ``.``,
``_`` or ``-`` becomes ``-``: a ``:`` would split the name, a ``/`` or a space would need
escaping in model URLs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from control.db.models import Job

_NOT_IN_MODEL_NAME = re.compile(r"[^A-Za-z0-9._-]")
_NAME = re.compile(r"^(?P<model>ft:.+?)(?::ckpt-step-(?P<step>\d{1,12}))?$")


def model_name_suffix(suffix: str) -> str:
    """The part of a fine-tuned model's name a user's ``suffix`` becomes."""
    return _NOT_IN_MODEL_NAME.sub("-", suffix)


def fine_tuned_model_id(job: Job) -> str:
    """``ft:<base>:<org>[:<suffix>]:<job id>`` (OpenAI's pattern, ids instead of names)."""
    suffix = f":{model_name_suffix(job.suffix)}" if job.suffix else ""
    return f"ft:{job.base_model}:{job.tenant_id}{suffix}:{job.id}"


def checkpoint_model_id(job: Job, step: int) -> str:
    return f"{fine_tuned_model_id(job)}:ckpt-step-{step}"


@dataclass(frozen=True)
class ModelName:
    """A fine-tuned model's name taken apart: the final model's name, the job that made it
    and the checkpoint's step (None: the final model)."""

    model: str
    job_id: str
    step: int | None

    def names(self, job: Job) -> bool:
        """Whether this is the name of a model of ``job`` (the name's every part, not only its id)."""
        return job.id == self.job_id and fine_tuned_model_id(job) == self.model


def parse_model_name(name: str) -> ModelName | None:
    """The parts of a fine-tuned model's or checkpoint's name; None for any other name."""
    match = _NAME.match(name)
    if match is None:
        return None
    return ModelName(match["model"], match["model"].rsplit(":", 1)[-1],
                     int(match["step"]) if match["step"] is not None else None)
