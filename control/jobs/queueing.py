"""A job waiting on its files: queued once they are validated, failed when one is refused.

A created job waits in ``validating_files`` until its training (and validation) file is
processed; :func:`advance_after_validation` runs when a file's validation ends (in the
worker, or at once when the file was processed already) and moves each waiting job on:
to ``queued`` with its hyperparameters resolved from the example count, or to ``failed``
with the file's first problems.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.models import File, Job
from control.errors import APIError
from control.job_settings import JobSettings
from control.jobs.hyperparameters import resolve_hyperparameters
from control.jobs.lifecycle import lock_job, transition
from trainers.spec import format_trains_method

# How many of a refused file's problems the job's error quotes.
MAX_FIRST_ERRORS = 5


def file_error(file: File, param: str) -> APIError:
    report = file.validation or {}
    errors = list(report.get("errors") or [])[:MAX_FIRST_ERRORS]
    where = "; ".join(
        f"line {e.get('line')}: {e.get('code')}: {e.get('message')}" if e.get("line") is not None
        else f"{e.get('code')}: {e.get('message')}"
        for e in errors
    )
    return APIError(
        400, "invalid_file",
        f"File '{file.id}' failed validation ({report.get('n_errors', len(errors))} problems)"
        + (f": {where}" if where else "."),
        param=param, details={"errors": errors, "n_errors": report.get("n_errors", len(errors))},
    )


def method_mismatch(file: File, method: str, param: str) -> APIError | None:
    """The error when validated ``file`` cannot train with ``method``; None when it can
    (or is not validated yet)."""
    found = (file.validation or {}).get("format")
    if file.status != "processed" or found is None or format_trains_method(found, method):
        return None
    if method == "reinforcement":
        message = (f"File '{file.id}' is in '{found}' format, but a reinforcement job (method.type "
                   "'reinforcement') trains on reinforcement prompts: lines whose 'messages' end in a "
                   "user turn, with the fields the grader reads as {{item.<field>}}.")
    elif found == "reinforcement":
        message = (f"File '{file.id}' holds reinforcement prompts ('messages' ending in a user turn, "
                   "with no assistant answer), which train only with method {\"type\": "
                   f"\"reinforcement\"}}; a{' DPO' if method == 'dpo' else ' supervised'} job needs "
                   + ("preference lines." if method == "dpo" else
                      "chat, prompt/completion, alpaca or ShareGPT lines with assistant answers."))
    elif method == "dpo":
        message = (f"File '{file.id}' is in '{found}' format, but a DPO job (method.type 'dpo') "
                   "trains on preference data: lines with 'input', 'preferred_output' and "
                   "'non_preferred_output'.")
    else:
        message = (f"File '{file.id}' holds preference data ('input', 'preferred_output', "
                   "'non_preferred_output'), which trains only with method "
                   "{\"type\": \"dpo\"}; a supervised job needs chat, prompt/completion, "
                   "alpaca or ShareGPT lines.")
    return APIError(400, "file_method_mismatch", message, param=param)


def queue_if_files_ready(session: Session, job: Job) -> bool:
    """validating_files -> queued (resolving "auto") or -> failed; True when queued."""
    files = [session.get_one(File, job.training_file)]
    if job.validation_file:
        files.append(session.get_one(File, job.validation_file))
    settings = JobSettings.from_row(job)
    method = settings.method.type
    for file, param in zip(files, ("training_file", "validation_file"), strict=False):
        error = file_error(file, param) if file.status == "error" else method_mismatch(file, method, param)
        if error is not None:
            transition(session, job, "failed", actor="system", message=error.message,
                       error={"code": error.code, "message": error.message, "param": param})
            return False
    if any(f.status != "processed" for f in files):
        return False
    n_examples = int((files[0].validation or {}).get("n_examples") or 0)
    resolved = resolve_hyperparameters(settings.stored_hyperparameters(), n_examples, method=method)
    transition(
        session, job, "queued", actor="system",
        message=f"Files validated ({n_examples} training examples); job queued.",
        hyperparameters=resolved, total_steps=resolved["total_steps"],
    )
    return True


def advance_after_validation(session: Session, file: File) -> list[str]:
    """Advance the jobs waiting on ``file``; returns the ids of jobs now queued."""
    waiting = session.scalars(
        select(Job.id).where(
            Job.status == "validating_files",
            (Job.training_file == file.id) | (Job.validation_file == file.id),
        )
    ).all()
    queued: list[str] = []
    for job_id in waiting:
        job = lock_job(session, job_id)
        if job is not None and job.status == "validating_files" and queue_if_files_ready(
            session, job
        ):
            queued.append(job.id)
    return queued
