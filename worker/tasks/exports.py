"""Celery task ``tunefleet.export_merged``: a job's adapter (final or a checkpoint's) merged
into its base model, written under the job's output as ``exports/<export id>/``.

``POST /v1/fine_tuning/jobs/{id}/exports`` checks the request and sends the task; the task
records its progress as job events ("started", then "ready" with the files, or "failed"
with the reason) and registers the files as the job's artifacts, so they are listed and
downloaded (with checksums) like every other output. Local artifact stores only: a merge
needs the base and the adapter on this worker's disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import select

from control.artifacts import sha256_file
from control.db.models import Artifact, Checkpoint, Job
from control.db.session import session_scope
from control.exports import EXPORTS_DIR, set_export_status
from control.job_settings import JobSettings
from control.jobs.lifecycle import add_event
from control.models.base_models import load_base_models
from control.reports.ingest import ADAPTER_WEIGHTS, apply_artifacts, job_storage
from control.reports.schemas import ArtifactsItem
from control.settings import Settings, get_settings
from worker.celery_app import app

log = logging.getLogger(__name__)

MAX_SHARD_SIZE = "5GB"
QLORA_NOTE = ("Trained with QLoRA against the base quantized to 4 bits, the adapter is merged here onto the "
              "dequantized (full-precision) base: close to, not the same as, what it was trained against.")


@app.task(name="tunefleet.export_merged", acks_late=True)
def export_merged_task(job_id: str, export_id: str, dtype: str, checkpoint_id: str | None = None) -> str:
    return run_merged_export(get_settings(), job_id, export_id, dtype, checkpoint_id)


def run_merged_export(settings: Settings, job_id: str, export_id: str, dtype: str,
                      checkpoint_id: str | None) -> str:
    """Merge, write, register; returns ``succeeded`` or ``failed`` (the reason is an event)."""
    from inference.merge import export_merged

    db_url = settings.resolved_database_url
    with session_scope(db_url) as session:
        job = session.get_one(Job, job_id)
        output = job_storage(job.id, settings).outputs[0]
        source = session.scalar(select(Artifact.location).where(Artifact.job_id == job.id,
                                                                Artifact.name == ADAPTER_WEIGHTS))
        if checkpoint_id is not None:
            source = session.scalar(select(Checkpoint.location).where(Checkpoint.job_id == job.id,
                                                                      Checkpoint.id == checkpoint_id))
        base = load_base_models(settings).get(job.base_model)
        qlora = JobSettings.from_row(job).adapter.method == "qlora"
        set_export_status(session, export_id, "running")
        add_event(session, job, f"Merged export {export_id} started ({dtype})",
                  data={"export": export_id, "dtype": dtype, "checkpoint": checkpoint_id})
        title = f"Job {job.id} merged{f' at checkpoint {checkpoint_id}' if checkpoint_id else ''}"
    target = Path(output) / EXPORTS_DIR / export_id
    try:
        if source is None or base is None:
            raise ValueError("the adapter or its base model is no longer there")
        export_merged(base.path, f"{source.rstrip('/')}/adapter", target, dtype=dtype,  # type: ignore[arg-type]
                      base_model=base.public_id, title=title, notes=[QLORA_NOTE] if qlora else [],
                      max_shard_size=MAX_SHARD_SIZE)
    except Exception as exc:  # reported to the user as the export's outcome
        log.exception("merged export %s of %s failed", export_id, job_id)
        with session_scope(db_url) as session:
            set_export_status(session, export_id, "failed")
            add_event(session, session.get_one(Job, job_id), f"Merged export {export_id} failed: {exc}",
                      level="error", data={"export": export_id})
        return "failed"
    files = [{"name": f"{EXPORTS_DIR}/{export_id}/{p.name}", "bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(target.iterdir()) if p.is_file()]
    with session_scope(db_url) as session:
        job = session.get_one(Job, job_id)
        apply_artifacts(session, job, ArtifactsItem(type="artifacts", location=output, files=files))
        set_export_status(session, export_id, "succeeded")
        add_event(session, job, f"Merged export {export_id} ready: {len(files)} files under {EXPORTS_DIR}/{export_id}/",
                  data={"export": export_id, "files": [f["name"] for f in files]})
    return "succeeded"
