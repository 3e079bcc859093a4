"""Where a fine-tuned model's PEFT adapter lives: a succeeded job's final adapter (its
outputs' ``adapter/``) or a checkpoint's (``step-<N>/adapter/``).

Completions serve it from there (``api.inference.served_models``) and a job that continues
the model trains on top of it (``worker.spec_builder``). Only a location inside the job's
own storage counts: a report can name nothing else, and a row pointing elsewhere is not
trusted.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.models import Artifact, Checkpoint, Job
from control.reports.ingest import ADAPTER_WEIGHTS, is_inside, job_storage
from control.settings import Settings

ADAPTER_DIR = "adapter"


def adapter_location(session: Session, settings: Settings, job: Job, step: int | None = None) -> str | None:
    """The adapter directory of ``job``'s final model (``step`` None) or of its checkpoint at
    ``step``; None when it is not stored (deleted, pruned, never written)."""
    storage = job_storage(job.id, settings)
    if step is None:
        location = session.scalar(select(Artifact.location).where(Artifact.job_id == job.id,
                                                                  Artifact.name == ADAPTER_WEIGHTS))
        roots = storage.outputs
    else:
        location = session.scalar(select(Checkpoint.location).where(Checkpoint.job_id == job.id,
                                                                    Checkpoint.step == step))
        roots = storage.checkpoints
    if location is None or not is_inside(location, roots):
        return None
    return f"{location.rstrip('/')}/{ADAPTER_DIR}"
