"""Filling the holes in a job's records from its trainer's outputs, when a run ends.

A trainer's reports are the job's records: a metric row per step, the checkpoints it
listed. They can fall short of what the trainer did: a run killed with items still in
memory, a pod whose spool died with it, a report the API never acknowledged before the
run ended. What the trainer did is also in storage: ``metrics.jsonl`` in its output dir
(a whole line per step) and its complete checkpoint folders (``step-<N>/`` with
``trainer_state.json``, which holds the metrics its listing carries).

:func:`fill_report_gaps`, run by the one outcome path (``worker.outcomes.apply_outcome``)
whenever a run of the job's current attempt ends, adds what storage has and the records
lack, and says so in an event; a requeued or paused job then resumes from the checkpoint
its trainer really wrote last. A succeeded run must leave every step's metrics and its
final checkpoint recorded: what storage cannot supply either is written to
``jobs.report_gaps`` (shown as the job's ``report_gaps``) with a warning event, so a job
never succeeds with holes silently.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from control.artifacts import ArtifactStore, LocalArtifactStore, artifact_store
from control.db.models import Checkpoint, Job, JobMetric
from control.jobs.lifecycle import add_event
from control.reports.ingest import apply_recovered
from control.reports.schemas import CheckpointItem, MetricItem
from control.settings import Settings
from worker.spec_builder import job_output_key

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"
TRAINER_STATE = "trainer_state.json"
_STATE_KEY = re.compile(r"(?:^|/)checkpoints/step-(\d+)/" + re.escape(TRAINER_STATE) + "$")


class TrainerOutputs:
    """What a job's trainers left in storage: the output's metrics log and the complete
    checkpoints, wherever the spec builder puts them (the artifact store -- a directory or
    a bucket -- and, for local trainers, ``<data>/jobs/<job>/checkpoints``). Read lazily,
    once each."""

    def __init__(self, settings: Settings, job_id: str) -> None:
        self.job_id = job_id
        self._artifacts = artifact_store(settings)
        self._stores: tuple[ArtifactStore, ...] = (self._artifacts, LocalArtifactStore(settings.jobs_dir))
        self._rows: dict[int, dict[str, Any]] | None = None
        self._checkpoints: dict[int, CheckpointItem] | None = None

    def metric_rows(self) -> dict[int, dict[str, Any]]:
        """The metrics log's rows by step (a step written twice: its last row)."""
        if self._rows is None:
            self._rows = {}
            for line in self._read(self._artifacts, f"{job_output_key(self.job_id)}/{METRICS_LOG}").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut short (a full disk, a kill mid-write) is no row
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    self._rows[row["step"]] = row
        return self._rows

    def checkpoints(self) -> dict[int, CheckpointItem]:
        """Complete checkpoints by step, as the items that would have listed them."""
        if self._checkpoints is None:
            self._checkpoints = {}
            for store in self._stores:
                for key in self._list(store, f"{self.job_id}/checkpoints"):
                    match = _STATE_KEY.search(key)
                    if match is None or int(match.group(1)) in self._checkpoints:
                        continue
                    try:
                        state = json.loads(self._read(store, key) or "{}")
                    except ValueError:
                        continue
                    step = int(match.group(1))
                    self._checkpoints[step] = CheckpointItem(
                        type="checkpoint", step=step, location=store.location(key.rsplit("/", 1)[0]),
                        metrics={k: v for k, v in (state.get("metrics") or {}).items()
                                 if isinstance(v, int | float) and not isinstance(v, bool)})
        return self._checkpoints

    def _read(self, store: ArtifactStore, key: str) -> str:
        try:
            return store.read_bytes(key).decode("utf-8", errors="replace") if store.exists(key) else ""
        except Exception:  # storage down or refusing: nothing can be read back from it now
            log.warning("%s: cannot read %s from %s", self.job_id, key, store.location(), exc_info=True)
            return ""

    def _list(self, store: ArtifactStore, prefix: str) -> list[str]:
        try:
            return store.list(prefix)
        except Exception:  # as in _read
            log.warning("%s: cannot list %s in %s", self.job_id, prefix, store.location(), exc_info=True)
            return []


@dataclass(frozen=True)
class Recovery:
    """What a reconciliation added, and what a succeeded run still lacks."""

    metric_steps: list[int]
    checkpoints: list[int]
    missing_metric_steps: list[int]
    missing_checkpoints: list[int]


def fill_report_gaps(session: Any, job: Job, outputs: TrainerOutputs, *, succeeded: bool) -> Recovery:
    """Add to ``job``'s records the metric rows and checkpoints ``outputs`` hold and they
    lack; for a ``succeeded`` run, record (``jobs.report_gaps``) and announce what is
    still missing. The caller holds the job locked and commits.
    """
    stored_steps = set(session.scalars(select(JobMetric.step).where(JobMetric.job_id == job.id)))
    listed = set(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job.id)))
    total = job.total_steps
    rows: dict[int, dict[str, Any]] = {}
    if not succeeded or total is None or not stored_steps >= set(range(1, total + 1)):
        rows = outputs.metric_rows()
    metric_items = [item for step, row in sorted(rows.items())
                    if step >= 1 and step not in stored_steps and (item := _metric_item(row)) is not None]
    found = outputs.checkpoints()
    checkpoint_items = [item for step, item in sorted(found.items()) if step not in listed]
    apply_recovered(session, job, [*metric_items, *checkpoint_items])
    recovered = Recovery([i.step for i in metric_items], [i.step for i in checkpoint_items], [], [])
    if recovered.metric_steps or recovered.checkpoints:
        add_event(session, job, "Recovered from the trainer's outputs what its reports never delivered: "
                                f"{_recovered_text(recovered)}.", level="warn",
                  data={"metric_steps": step_ranges(recovered.metric_steps), "checkpoints": recovered.checkpoints})
    if not succeeded:
        return recovered
    total = job.total_steps or max((int(r.get("total_steps") or 0) for r in rows.values()), default=0)
    have = stored_steps | set(recovered.metric_steps)
    missing_steps = sorted(set(range(1, total + 1)) - have) if total else []
    missing_checkpoints = [total] if total and total not in listed | set(recovered.checkpoints) else []
    if not total and not have:
        job.report_gaps = {"missing_metric_steps": "all", "missing_checkpoints": []}
        add_event(session, job, "No metrics were reported and the trainer's outputs have none either.",
                  level="warn", data=job.report_gaps)
    elif missing_steps or missing_checkpoints:
        job.report_gaps = {"missing_metric_steps": step_ranges(missing_steps),
                           "missing_checkpoints": missing_checkpoints}
        add_event(session, job, "The job's records are incomplete, and the trainer's outputs cannot complete them: "
                                f"{_missing_text(missing_steps, missing_checkpoints)}.", level="warn",
                  data=job.report_gaps)
    else:
        job.report_gaps = None
    return Recovery(recovered.metric_steps, recovered.checkpoints, missing_steps, missing_checkpoints)


def _metric_item(row: dict[str, Any]) -> MetricItem | None:
    try:
        return MetricItem.model_validate({**row, "type": "metric"})
    except ValueError:  # a row this service cannot store (pydantic's ValidationError)
        log.warning("metrics log row of step %s not recoverable", row.get("step"), exc_info=True)
        return None


def step_ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5,9"``."""
    parts: list[str] = []
    for step in sorted(steps):
        if parts and step == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{step}"
        else:
            parts.append(str(step))
    return ",".join(parts)


def _recovered_text(recovered: Recovery) -> str:
    said = []
    if recovered.metric_steps:
        said.append(f"the metrics of steps {step_ranges(recovered.metric_steps)}")
    if recovered.checkpoints:
        said.append(f"the checkpoint(s) of step(s) {', '.join(map(str, recovered.checkpoints))}")
    return " and ".join(said)


def _missing_text(steps: list[int], checkpoints: list[int]) -> str:
    said = []
    if steps:
        said.append(f"no metrics for steps {step_ranges(steps)}")
    if checkpoints:
        said.append(f"no final checkpoint (step {checkpoints[0]})")
    return " and ".join(said)
