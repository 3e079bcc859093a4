"""A finished job's results file: OpenAI's per-step metrics CSV, stored as a file of the
job's tenant (purpose ``fine-tune-results``) and listed in the job's ``result_files``."""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.artifacts import ArtifactStore
from control.db.models import File, Job, JobMetric
from control.ids import new_id

RESULTS_PURPOSE = "fine-tune-results"  # written by the service for a finished job


RESULTS_FILENAME = "step_metrics.csv"


# OpenAI's results CSV columns, and the stored metric each one is read from.
RESULTS_COLUMNS = {
    "step": "step",
    "train_loss": "train_loss",
    "train_accuracy": "token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_token_accuracy",
}


def results_csv(metrics: Iterable[JobMetric]) -> bytes:
    """OpenAI's per-step results CSV of ``metrics`` (a header, then one row per step).

    A metric the trainer did not report (no validation set, a NaN stored as null) is an
    empty cell. Floats are written with ``repr``, so they read back exactly.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULTS_COLUMNS)
    for row in metrics:
        writer.writerow("" if (v := getattr(row, attr)) is None else v for attr in RESULTS_COLUMNS.values())
    return out.getvalue().encode()


def create_result_file(session: Session, job: Job, *, store: ArtifactStore) -> File:
    """Store ``job``'s metrics as a ``fine-tune-results`` file of its tenant; the caller commits.

    The content is written to ``store`` (the files API's storage) before the row is added:
    if the caller's transaction then fails, an unreferenced blob is left, never a file row
    without content. Put the returned id into ``job.result_files`` in the same transaction.
    """
    metrics = session.scalars(select(JobMetric).where(JobMetric.job_id == job.id).order_by(JobMetric.step))
    content = results_csv(metrics)
    file_id = new_id("file")
    key = f"files/{file_id}.csv"
    store.put_bytes(key, content)
    row = File(
        id=file_id, tenant_id=job.tenant_id, filename=RESULTS_FILENAME, bytes=len(content),
        purpose=RESULTS_PURPOSE, status="processed", location=key,
        sha256=hashlib.sha256(content).hexdigest(),
    )
    session.add(row)
    return row
