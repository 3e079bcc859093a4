"""The scheduler's view of the database: queued jobs in, admissions and reasons out.

``DbStore`` implements the cycle's ``SchedulerStore`` on the service's DB. Every status
change goes through ``control.jobs.lifecycle.transition`` (actor ``scheduler`` or ``executor``)
with the row locked (``lock_job``; admissions lock their chunk of rows in one
``SELECT … FOR UPDATE``), so the scheduler, the API and trainer reports never overwrite
each other. Besides statuses it writes ``queue_reason`` (shown on
``GET /v1/fine_tuning/jobs/{id}``; an event only when the reason changes),
``queue_position``, ``pool``, ``gpus``, ``estimate`` and ``usage`` (see
``scheduling.usage``).

A cycle of 10,000 queued jobs writes thousands of rows, so writes are batched: admissions
in transactions of ``ADMIT_CHUNK`` jobs (one flush each), waiting reasons and positions
in one executemany ``UPDATE`` per ``WAITING_CHUNK`` (bench/scheduler_cycle_db.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from pydantic import ValidationError
from sqlalchemy import bindparam, insert, or_, select, update

from control.artifacts import file_store
from control.db.base import utcnow
from control.db.models import File, Job, JobEvent, PoolCapacity
from control.db.session import begin_write, session_scope
from control.errors import APIError
from control.ids import hash_secret, new_job_token
from control.job_settings import SETTINGS_COLUMNS, JobSettings, PlacementSettings
from control.jobs.lifecycle import add_event, event_values, lock_job, transition
from control.models.base_models import load_base_models
from control.settings import Settings
from scheduling.capacity import CapacitySnapshot
from scheduling.estimator import EstimateError, ModelShape
from scheduling.model_files import base_model_shape
from scheduling.pools import NodePool
from scheduling.request import DataStats, JobRequest, request_from_job
from scheduling.throughput import throughput_basis
from scheduling.usage import close_segment, gpu_seconds_since, open_segment, pending_segment
from worker.executors.base import ObservedChange, RunningRow
from worker.outcomes import apply_outcome
from worker.report_gaps import TrainerOutputs
from worker.scheduler.cycle import Admission, Admitted, Unfit, Waiting

log = logging.getLogger(__name__)

# How long after a job left ``running`` the scheduler waits, beyond the stop grace, for
# the old run's outcome before it starts the next attempt anyway (the outcome may never
# come, e.g. the executor restarted and the Job was already gone).
STOP_MARGIN_S = 60.0
ADMIT_CHUNK = 500  # admissions per transaction: row locks held well under a second
WAITING_CHUNK = 5_000  # waiting reasons/positions per transaction

# What a queued job's placement needs (its settings, the JobRequest), and its current reason/position.
_QUEUE_COLUMNS = (Job.id, Job.tenant_id, Job.base_model, Job.training_file,
                  *(getattr(Job, name) for name in SETTINGS_COLUMNS),
                  Job.resume_from, Job.usage, Job.priority, Job.created_at,
                  Job.queue_reason, Job.queue_position, Job.retry_placement, Job.attempt,
                  Job.exited_attempt, Job.restart_not_before, Job.restarts)


_settings_columns = attrgetter(*SETTINGS_COLUMNS)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"


def _pins(user: PlacementSettings, retry: dict[str, Any] | None) -> PlacementSettings:
    """The user's pins; after an out-of-memory failure, the larger gang on the same pool
    (``jobs.retry_placement``) where the user pinned no pool or GPU count."""
    if not retry:
        return user
    gang = PlacementSettings.model_validate(retry)
    return user.model_copy(update={"pool": user.pool if user.pool is not None else gang.pool,
                                   "gpus": user.gpus if user.gpus is not None else gang.gpus})


@dataclass(frozen=True)
class JobHandle:
    """What the executor gets for a job (``JobRef`` plus labels it puts on objects)."""

    id: str
    tenant_id: str
    priority: int
    attempt: int | None = None  # the run attempt this launch is (labels, the local task)


class DbStore:
    """``SchedulerStore`` on the service database."""

    def __init__(self, settings: Settings, pools: list[NodePool], *, in_cluster: bool = False,
                 clock: Any = time.time, max_restarts: int | None = None) -> None:
        """``max_restarts``: lost runs (node lost, evicted, crashed, out of GPU memory) a job
        may restart from its checkpoint before it fails; default ``settings.max_restarts``,
        the same cap the local executor applies."""
        self.settings = settings
        self.url = settings.resolved_database_url
        self.pools = {p.name: p for p in pools}
        self.in_cluster = in_cluster
        self.clock = clock
        self.max_restarts = settings.max_restarts if max_restarts is None else max_restarts
        # Kueue's LocalQueue when the Kubernetes executor leaves starting Jobs to Kueue.
        self.kueue_queue = settings.kueue_queue if in_cluster else None
        self._reasons: dict[str, str | None] = {}
        self._positions: dict[str, int | None] = {}
        # Each queued job's settings columns as last read, and the settings parsed from them.
        self._settings: dict[str, tuple[tuple[Any, ...], JobSettings]] = {}
        # Each training file's token stats (its validation report's, fixed once validated).
        self._file_stats: dict[str, DataStats | None] = {}

    # --- reading -----------------------------------------------------------------------
    def queued(self) -> list[JobRequest]:
        models = load_base_models(self.settings)
        out: list[JobRequest] = []
        unplaceable: list[tuple[str, str, int | None]] = []
        with session_scope(self.url) as session:
            # Only the columns placement needs (10,000 rows: a third of the time of whole rows).
            # (a job admitted while Kueue holds its launch is queued but placed already)
            rows = session.execute(select(*_QUEUE_COLUMNS).where(
                Job.status == "queued", Job.awaiting_start_since.is_(None))).all()
            self._read_file_stats(session, {j.training_file for j in rows if j.training_file})
        self._reasons = {j.id: j.queue_reason for j in rows}
        self._positions = {j.id: j.queue_position for j in rows}
        shapes: dict[str, ModelShape | EstimateError] = {}  # per base model, read once per cycle
        parsed, self._settings = self._settings, {}
        now = self.clock()
        for job in rows:
            if self._previous_run_may_live(job, now):
                unplaceable.append((job.id, "waiting: its previous run is still stopping (writing its checkpoint)",
                                    None))
                continue
            if job.restart_not_before is not None and job.restart_not_before.timestamp() > now:
                # A fixed time, not a countdown: each new reason text is an event.
                at = job.restart_not_before.astimezone(dt.UTC).strftime("%H:%M:%S UTC")
                reason = f"waiting: restart {job.restarts} starts at {at} (backoff after a lost run)"
                unplaceable.append((job.id, reason, None))
                continue
            try:
                settings = self._job_settings(job, parsed)
            except ValidationError as exc:  # one unreadable row must not stop every tenant's jobs
                unplaceable.append((job.id, f"waiting: its stored settings cannot be read ({_first_error(exc)})",
                                    None))
                continue
            try:
                out.append(self._request(job, models, shapes, settings))
            except EstimateError as exc:
                unplaceable.append((job.id, f"waiting: {exc}", None))
        self._write_waiting(unplaceable)
        return out

    def _read_file_stats(self, session: Any, file_ids: set[str]) -> None:
        """Read the token stats of the training files not read yet (a queued job's file
        is validated: its report no longer changes)."""
        if len(self._file_stats) > 100_000:  # files of jobs long gone: start over
            self._file_stats = {}
        missing = [f for f in file_ids if f not in self._file_stats]
        for start in range(0, len(missing), WAITING_CHUNK):
            chunk = missing[start:start + WAITING_CHUNK]
            for file_id, report in session.execute(select(File.id, File.validation).where(File.id.in_(chunk))):
                self._file_stats[file_id] = DataStats.from_report(report)

    def _previous_run_may_live(self, job: Any, now: float) -> bool:
        """True while the trainer of the job's last attempt may still run: no outcome of it
        yet, and its stop began less than the stop grace (plus a margin) ago. Starting the
        next attempt then would put two trainers on one job's checkpoints."""
        if (job.exited_attempt or 0) >= (job.attempt or 0):
            return False
        segments = (job.usage or {}).get("segments") or []
        left_running = segments[-1].get("end") if segments else None
        if left_running is None:
            return False
        return now - float(left_running) < self.settings.stop_grace_s + STOP_MARGIN_S

    def _job_settings(self, job: Any, parsed: dict[str, tuple[tuple[Any, ...], JobSettings]]) -> JobSettings:
        """The job's settings, parsed again only when its settings columns changed since the
        last cycle: every cycle reads every queued job, and most of them wait unchanged."""
        columns = _settings_columns(job)
        known = parsed.get(job.id)
        settings = known[1] if known is not None and known[0] == columns else JobSettings.from_row(job)
        self._settings[job.id] = (columns, settings)
        return settings

    def _request(self, job: Any, models: dict[str, Any], shapes: dict[str, ModelShape | EstimateError],
                 settings: JobSettings) -> JobRequest:
        entry = models.get(job.base_model)
        if entry is None:
            raise EstimateError(f"base model {job.base_model!r} is not configured", "model_not_found")
        if job.base_model not in shapes:
            try:
                shapes[job.base_model] = base_model_shape(entry.path, entry.params_b, model_id=job.base_model)[0]
            except EstimateError as exc:
                shapes[job.base_model] = exc
        shape = shapes[job.base_model]
        if isinstance(shape, EstimateError):
            raise shape
        return request_from_job(
            job_id=job.id, tenant=job.tenant_id, model=shape, settings=settings,
            placement=_pins(settings.placement, job.retry_placement),
            priority=int(job.priority or 0),
            created_at=job.created_at.timestamp() if job.created_at else 0.0,
            checkpoint_trainer=(job.usage or {}).get("trainer") if job.resume_from else None,
            data=self._file_stats.get(job.training_file) if job.training_file else None,
        )

    def running_jobs(self) -> list[RunningRow]:
        """Every job ``running`` now, or admitted and waiting for Kueue to start it: what
        the executor must be observing."""
        with session_scope(self.url) as session:
            rows = session.execute(select(Job.id, Job.tenant_id, Job.priority, Job.pool, Job.gpus, Job.started_at)
                                   .where(or_(Job.status == "running", Job.awaiting_start_since.is_not(None)))).all()
        return [RunningRow(jid, tenant, int(priority or 0), pool, gpus, _timestamp(started))
                for jid, tenant, priority, pool, gpus, started in rows]

    def job_statuses(self, job_ids: Collection[str]) -> dict[str, str]:
        """The status of each of these jobs that has a row (what a Job that outlived its
        job's ``running`` is stopped by)."""
        with session_scope(self.url) as session:
            rows = session.execute(select(Job.id, Job.status).where(Job.id.in_(list(job_ids)))).all()
        return {jid: status for jid, status in rows}

    def recent_gpu_seconds(self, since: float) -> dict[tuple[str, str], float]:
        """GPU-seconds per (tenant, pool) since ``since`` (the fair-share window): the
        usage of every job that had not finished before it."""
        with session_scope(self.url) as session:
            rows = session.execute(
                select(Job.tenant_id, Job.usage).where(Job.usage.is_not(None)).where(
                    or_(Job.finished_at.is_(None), Job.finished_at >= dt.datetime.fromtimestamp(since, dt.UTC)))
            ).all()
        return gpu_seconds_since(rows, since, now=self.clock())

    # --- writing -----------------------------------------------------------------------
    def admit(self, admissions: Sequence[Admission]) -> Iterator[Admitted]:
        """In transactions of ``ADMIT_CHUNK`` jobs, yielded after each commit. A chunk that
        fails as a whole (a database error) is retried one job per transaction, so one bad
        job never keeps the others out."""
        for start in range(0, len(admissions), ADMIT_CHUNK):
            chunk = admissions[start:start + ADMIT_CHUNK]
            try:
                done = self._admit_chunk(chunk)
            except Exception:
                log.exception("admission of %d job(s) in one transaction failed", len(chunk))
                done = []
                for adm in chunk if len(chunk) > 1 else ():
                    try:
                        done += self._admit_chunk([adm])
                    except Exception:
                        log.exception("admission of %s failed", adm.job.job_id)
            yield from done

    def _admit_chunk(self, chunk: Sequence[Admission]) -> list[Admitted]:
        from worker.spec_builder import SpecError, build_spec, job_step

        out: list[Admitted] = []
        with session_scope(self.url) as session:
            session.expire_on_commit = False  # nothing is read after the commit: skip expiring 500 rows
            begin_write(session)
            # Lock the rows in one statement, in id order (the lock order of any other
            # multi-row writer), and read their files into the session for build_spec.
            ids = sorted(a.job.job_id for a in chunk)
            jobs = {j.id: j for j in session.scalars(
                select(Job).where(Job.id.in_(ids)).order_by(Job.id).with_for_update())}
            file_ids = {f for j in jobs.values() for f in (j.training_file, j.validation_file) if f}
            # Held in a variable: the session's identity map keeps only referenced objects.
            _files = session.scalars(select(File).where(File.id.in_(file_ids))).all()
            now = self.clock()
            for adm in chunk:
                job, placement = jobs.get(adm.job.job_id), adm.placement
                if job is None or job.status != "queued":
                    log.warning("%s not admitted: no longer queued", adm.job.job_id)
                    continue
                pool = self.pools[placement.pool or ""]
                token = new_job_token()
                trainer = placement.trainer or pool.preferred_trainer()
                try:
                    # The micro batch and rematerialization the placed gang runs fastest with.
                    step = job_step(job, model=adm.job.model, training=adm.job.training,
                                    pool_accelerator=pool.accelerator, device_bytes=pool.gpu_memory_bytes,
                                    trainer=trainer, gpus=placement.gpus, in_cluster=self.in_cluster,
                                    offload_allowed=placement.offload)
                    spec = build_spec(session, job, self.settings, pool_accelerator=pool.accelerator,
                                      pool_families=(trainer,),
                                      gpus=placement.gpus, token=token, in_cluster=self.in_cluster,
                                      cpu_offload=placement.offload, step=step)
                except SpecError as exc:
                    log.warning("%s not admitted: %s", job.id, exc)
                    transition(session, job, "failed", actor="scheduler", message=str(exc), flush=False,
                               error={"code": exc.code, "message": str(exc)})
                    continue
                est = placement.estimate
                admitted = f"Admitted on pool {pool.name}: {placement.gpus}x {pool.accelerator} ({placement.trainer})"
                changes = {
                    "data": {"pool": pool.name, "gpus": placement.gpus, "nodes": [list(n) for n in placement.nodes]},
                    "pool": pool.name, "gpus": placement.gpus, "job_token_hash": hash_secret(token),
                    "attempt": (job.attempt or 0) + 1,
                    # Keep the estimate shown at creation; add the one this admission used,
                    # the step chosen for it (a resumed run keeps it: ``job_step``) and the
                    # basis of its steps' MFU on this gang (``scheduling.throughput``).
                    "estimate": {**(job.estimate or {}), **({"admitted": est.to_dict()} if est else {}),
                                 **({"step": step.to_dict()} if step else {}),
                                 "throughput": throughput_basis(adm.job.model, adm.job.training, trainer=trainer,
                                                                gpus=placement.gpus, peak_tflops=pool.peak_tflops)}}
                if self.kueue_queue:
                    # Kueue starts the Job (created suspended) when its own quota allows:
                    # until then the job stays queued, holds no GPUs and is billed nothing.
                    waiting = f"admitted, waiting for Kueue (LocalQueue {self.kueue_queue})"
                    transition(session, job, "queued", actor="scheduler", flush=False,
                               message=f"{admitted}; waiting for Kueue (LocalQueue {self.kueue_queue}) to start it.",
                               queue_reason=waiting, awaiting_start_since=utcnow(), **changes,
                               usage=pending_segment(job.usage, pool=pool.name, gpus=placement.gpus,
                                                     price_per_gpu_hour=pool.price_per_gpu_hour,
                                                     trainer=placement.trainer))
                    self._reasons[job.id] = waiting
                else:
                    transition(session, job, "running", actor="scheduler", flush=False, message=f"{admitted}.",
                               queue_reason=None, **changes,
                               usage=open_segment(job.usage, pool=pool.name, gpus=placement.gpus, now=now,
                                                  price_per_gpu_hour=pool.price_per_gpu_hour,
                                                  trainer=placement.trainer))
                if step is not None:
                    add_event(session, job, f"Step: {step.describe()}.", data={"step": step.to_dict()},
                              level="info" if step.fits else "warn")
                out.append(Admitted(adm, JobHandle(job.id, job.tenant_id, int(job.priority or 0), job.attempt), spec))
        return out

    def launch_failed(self, req: JobRequest, error: Exception) -> None:
        with session_scope(self.url) as session:
            job = lock_job(session, req.job_id)
            if job is not None and (job.status == "running" or job.awaiting_start_since is not None):
                transition(session, job, "queued", actor="scheduler",
                           message=f"Launch failed ({error}); requeued.", level="warn",
                           usage=close_segment(job.usage, now=self.clock()), exited_attempt=job.attempt)

    def preempting(self, victim_id: str, for_job: str) -> JobHandle | None:
        with session_scope(self.url) as session:
            job = lock_job(session, victim_id)
            if job is None or job.status != "running":
                return None
            add_event(session, job, f"Preempted by higher-priority job {for_job}: checkpointing, then "
                                    "requeued to resume from the checkpoint.", level="warn")
            return JobHandle(job.id, job.tenant_id, int(job.priority or 0))

    def set_waiting(self, waiting: Sequence[Waiting]) -> None:
        self._write_waiting([(w.job.job_id, w.reason, w.position) for w in waiting])

    def fail_unfit(self, unfit: Sequence[Unfit]) -> None:
        for item in unfit:
            with session_scope(self.url) as session:
                job = lock_job(session, item.job.job_id)
                if job is None or job.status != "queued":
                    continue
                transition(session, job, "failed", actor="scheduler", message=item.message, level="error",
                           error={"code": "no_pool_fits", "message": item.message, "param": "placement"})

    def _write_waiting(self, items: Sequence[tuple[str, str, int | None]]) -> None:
        """(job id, reason, position) of waiting jobs: one UPDATE per chunk for those whose
        reason or position changed, and an event for each new reason, only on jobs still
        queued (a job cancelled meanwhile keeps its row as the API left it)."""
        changed = [(jid, reason, pos) for jid, reason, pos in items
                   if self._reasons.get(jid) != reason or self._positions.get(jid) != pos]
        table = Job.__table__
        update_stmt = (update(table)
                       .where(table.c.id == bindparam("b_id"), table.c.status == "queued")
                       .values(queue_reason=bindparam("b_reason"), queue_position=bindparam("b_position")))
        for start in range(0, len(changed), WAITING_CHUNK):
            chunk = changed[start:start + WAITING_CHUNK]
            new_reason = {jid: reason for jid, reason, _ in chunk if self._reasons.get(jid) != reason}
            with session_scope(self.url) as session:
                begin_write(session)
                session.execute(update_stmt, [{"b_id": jid, "b_reason": reason, "b_position": pos}
                                              for jid, reason, pos in chunk])
                if new_reason:
                    # The UPDATE locked the rows it wrote: the ones that show our reason now
                    # are exactly those (still queued until this commits).
                    written = session.execute(select(Job.id, Job.queue_reason)
                                              .where(Job.id.in_(new_reason), Job.status == "queued")).all()
                    now = utcnow()
                    events = [reason_event(jid, reason, now) for jid, reason in written
                              if reason == new_reason[jid]]
                    if events:
                        session.execute(insert(JobEvent.__table__), events)
            for jid, reason, pos in chunk:
                self._reasons[jid], self._positions[jid] = reason, pos

    def publish_capacity(self, snapshot: CapacitySnapshot) -> None:
        now = dt.datetime.now(dt.UTC)
        with session_scope(self.url) as session:
            for pool, nodes in snapshot.nodes.items():
                row = session.get(PoolCapacity, pool) or PoolCapacity(pool=pool)
                row.nodes = [{"name": n.name, "gpus_total": n.gpus_total, "gpus_free": n.gpus_free}
                             for n in nodes.values()]
                row.observed_at = now
                session.add(row)

    def apply_observed(self, changes: list[ObservedChange]) -> None:
        for ch in changes:
            try:
                with session_scope(self.url) as session:
                    job = lock_job(session, ch.job_id)
                    if job is not None:
                        self._apply(session, job, ch)
            except APIError as exc:  # a race with the API (e.g. cancelled meanwhile): log, go on
                log.info("observed %s for %s not applied: %s", ch.kind.value, ch.job_id, exc)

    def _apply(self, session: Any, job: Job, ch: ObservedChange) -> None:
        apply_outcome(session, job, ch, files=file_store(self.settings), pools=self.pools,
                      max_restarts=self.max_restarts, now=self.clock(),
                      restart_backoff=(self.settings.restart_backoff_s, self.settings.restart_backoff_max_s),
                      outputs=TrainerOutputs(self.settings, job.id))


def reason_event(job_id: str, reason: str, now: dt.datetime) -> dict[str, Any]:
    """The event row for a new waiting reason (sentence case, the rest as written: "GPUs",
    pool names)."""
    return event_values(job_id, reason[:1].upper() + reason[1:], data={"queue_reason": reason}, created_at=now)


def _timestamp(value: dt.datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()  # SQLite drops the zone
