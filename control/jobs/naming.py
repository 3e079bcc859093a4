"""The names of a job's models: ``ft:<base>:<org>[:<suffix>]:<job id>`` for the final
adapter and ``...:ckpt-step-<n>`` for each checkpoint.

In the name every character of the user's ``suffix`` other than a letter, digit, ``.``,
``_`` or ``-`` becomes ``-``: a ``:`` would split the name, a ``/`` or a space would need
escaping in model URLs.
"""

from __future__ import annotations

import re

from control.db.models import Job

_NOT_IN_MODEL_NAME = re.compile(r"[^A-Za-z0-9._-]")


def model_name_suffix(suffix: str) -> str:
    """The part of a fine-tuned model's name a user's ``suffix`` becomes."""
    return _NOT_IN_MODEL_NAME.sub("-", suffix)


def fine_tuned_model_id(job: Job) -> str:
    """``ft:<base>:<org>[:<suffix>]:<job id>`` (OpenAI's pattern, ids instead of names)."""
    suffix = f":{model_name_suffix(job.suffix)}" if job.suffix else ""
    return f"ft:{job.model}:{job.tenant_id}{suffix}:{job.id}"


def checkpoint_model_id(job: Job, step: int) -> str:
    return f"{fine_tuned_model_id(job)}:ckpt-step-{step}"
