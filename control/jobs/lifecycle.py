"""The job lifecycle: ONE function changes ``Job.status``, governed by an ordered rules table.

``transition(session, job, to, actor=..., message=...)`` looks up the first rule whose
from-states contain the job's status and whose to-state is ``to``; the rule names the
actors allowed to cause it. If there is none (or the actor is not allowed) it raises a
409 ``invalid_state_transition`` that says what is possible instead. Otherwise it writes
the new status, the time stamps, any extra column ``changes``, and a
``fine_tuning.job.event`` (stored as type ``status``; OpenAI's clients get it as a
``message`` with ``from``, ``to`` and ``actor`` in ``data``) in the caller's transaction, then calls the
registered transition hooks (webhooks, Prometheus) with the same session, so a hook's
writes commit or roll back together with the transition. The caller commits.

Concurrent writers (API, scheduler, executor, report endpoint) lock the job row first
with ``lock_job`` (``SELECT … FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite).

Statuses::

    validating_files -> queued -> running -> succeeded | failed | cancelled
                          ^  \\        |  \\
                          |   paused <-+   (running -> queued: preemption / restart,
                          +----/              with resume_from = last checkpoint)

With Kueue, the scheduler's admission leaves the job ``queued`` with
``awaiting_start_since`` set (its Job waits, suspended, for Kueue); it turns ``running``
when the trainer starts, and any other transition ends the wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.base import utcnow
from control.db.models import TERMINAL_STATUSES, Job, JobEvent
from control.db.session import begin_write
from control.errors import APIError
from control.ids import new_id
from scheduling.usage import close_segment, drop_pending, start_pending

log = logging.getLogger(__name__)

# An event's ``level`` and ``type`` as stored. The levels are OpenAI's. The types are
# OpenAI's ``message`` and ``metrics``, and ``status`` for the status changes this module
# writes: the API sends those as ``message`` (``api.jobs.schemas.JobEventPublic``), and
# the type is how the service itself finds them (trainer data cannot forge one).
EVENT_LEVELS = ("info", "warn", "error")
EVENT_TYPES = ("message", "metrics", "status")

Status = Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]
Actor = Literal["user", "admin", "scheduler", "executor", "trainer", "system"]

PEOPLE: frozenset[str] = frozenset({"user", "admin"})
MACHINES: frozenset[str] = frozenset({"scheduler", "executor", "trainer", "system"})


@dataclass(frozen=True)
class Rule:
    """Jobs in ``from_states`` may move to ``to`` when caused by one of ``actors``."""

    from_states: frozenset[str]
    to: str
    actors: frozenset[str]
    why: str


def _rule(from_states: str, to: str, actors: frozenset[str] | set[str], why: str) -> Rule:
    return Rule(frozenset(from_states.split()), to, frozenset(actors), why)


# Ordered: the first rule matching (from, to) decides which actors may cause it.
RULES: tuple[Rule, ...] = (
    _rule("validating_files", "queued", {"system"}, "all files validated"),
    _rule("validating_files", "failed", {"system"}, "a file failed validation"),
    # The scheduler admits; a job admitted while the cluster's own queue (Kueue) holds its
    # launch starts running when its trainer does, as the executor or the trainer's
    # first report sees first.
    _rule("queued", "running", {"scheduler", "executor", "trainer"}, "admitted on a node pool"),
    _rule("running", "queued", {"scheduler", "executor", "system"},
          "preempted or restarted from its last checkpoint"),
    _rule("queued", "queued", {"scheduler", "executor", "system"}, "requeued"),
    _rule("running", "succeeded", {"executor", "trainer"}, "the trainer exported the adapter"),
    _rule("running", "failed", {"executor", "trainer", "system"}, "the trainer failed"),
    _rule("queued", "failed", {"scheduler", "executor", "system"}, "the job can never be placed or start"),
    _rule("queued running", "paused", PEOPLE | {"system"}, "paused (a checkpoint is kept)"),
    _rule("paused", "queued", PEOPLE | {"system"}, "resumed from its last checkpoint"),
    _rule("validating_files queued running paused", "cancelled", PEOPLE | {"system"},
          "cancelled"),
)

TransitionHook = Callable[[Session, Job, str, str, str], None]
_hooks: list[TransitionHook] = []


def register_transition_hook(hook: TransitionHook) -> TransitionHook:
    """Call ``hook(session, job, from_status, to_status, actor)`` after every transition.

    Hooks run inside the transition's transaction (a webhook outbox row written by a hook
    commits with the status). A hook that raises aborts the transition. Returns ``hook``
    so it can be used as a decorator; registering the same function twice is a no-op.
    """
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


def unregister_transition_hook(hook: TransitionHook) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def find_rule(from_status: str, to: str) -> Rule | None:
    """The first rule for ``from_status -> to`` (None: that move never happens)."""
    for rule in RULES:
        if from_status in rule.from_states and rule.to == to:
            return rule
    return None


def allowed_targets(from_status: str, actor: str) -> list[str]:
    """Where ``actor`` may move a job in ``from_status`` (for error messages and the UI)."""
    seen: list[str] = []
    for rule in RULES:
        if from_status in rule.from_states and actor in rule.actors and rule.to not in seen:
            seen.append(rule.to)
    return seen


def check_transition(from_status: str, to: str, actor: str) -> Rule:
    """The rule allowing ``from_status -> to`` by ``actor``, or a 409 explaining why not."""
    rule = find_rule(from_status, to)
    if rule is None or actor not in rule.actors:
        if from_status in TERMINAL_STATUSES:
            detail = f"the job already {from_status}; its status no longer changes"
        elif rule is None:
            targets = allowed_targets(from_status, actor)
            detail = "possible: " + (", ".join(targets) if targets else "nothing")
        else:
            detail = f"only {', '.join(sorted(rule.actors))} may do that"
        raise APIError(
            409, "invalid_state_transition",
            f"Cannot move a job from '{from_status}' to '{to}' ({actor}): {detail}.",
            param="status",
        )
    return rule


def transition(
    session: Session,
    job: Job,
    to: Status | str,
    *,
    actor: Actor | str,
    message: str | None = None,
    level: str = "info",
    data: dict[str, Any] | None = None,
    flush: bool = True,
    **changes: Any,
) -> JobEvent:
    """Move ``job`` to ``to`` as ``actor``; the only writer of ``Job.status``.

    Args:
        session: the caller's session; the caller commits.
        job: the job (lock it with ``lock_job`` when several processes may race).
        to: the new status.
        actor: who causes it (``user``, ``admin``, ``scheduler``, ``executor``,
            ``trainer``, ``system``).
        message: the event text shown to users (default: a generic one).
        level: event level (``info``, ``warn``, ``error``).
        data: extra event data.
        flush: write the change at once (default). A caller moving many jobs in one
            transaction (the scheduler's admissions) passes False and flushes once.
        **changes: other ``Job`` columns to set in the same write (``error=…``,
            ``pool=…``, ``resume_from=…``); ``status`` is refused here.

    Returns:
        The ``fine_tuning.job.event`` written.

    Raises:
        APIError: 409 ``invalid_state_transition``.
    """
    if "status" in changes:
        raise TypeError("pass the new status as `to`, not as a change")
    from_status = job.status
    rule = check_transition(from_status, to, actor)
    now = utcnow()
    for name, value in changes.items():
        if not hasattr(Job, name):
            raise TypeError(f"Job has no column {name!r}")
        setattr(job, name, value)
    if job.awaiting_start_since is not None and "awaiting_start_since" not in changes:
        # The admitted launch the cluster held either started (its usage segment opens
        # now) or never will: any transition ends the wait.
        job.awaiting_start_since = None
        if "usage" not in changes:
            job.usage = start_pending(job.usage, now=now.timestamp()) if to == "running" else drop_pending(job.usage)
    if from_status == "running" and to != "running" and "usage" not in changes and job.usage:
        # GPUs are held only while running: whoever moves the job out (a cancel or pause
        # through the API, a report, an executor) ends its usage segment here, so none
        # stays open and every run is billed.
        job.usage = close_segment(job.usage, now=now.timestamp())
    job.status = to
    if to == "running" and job.started_at is None:
        job.started_at = now
    if to in TERMINAL_STATUSES:
        job.finished_at = now
        job.estimated_finish = None
    if to in ("queued", "paused"):
        job.estimated_finish = None
    if to != "queued":
        job.queue_position = None  # a place in the queue means something only while queued
    event = add_event(
        session, job,
        message or f"Job {to.replace('_', ' ')}: {rule.why}.",
        level=level if to != "failed" or level != "info" else "error",
        type="status",
        data={"from": from_status, "to": to, "actor": actor, **(data or {})},
        created_at=now,
    )
    if flush:
        session.flush()
    for hook in _hooks:
        hook(session, job, from_status, to, actor)
    return event


def start_admitted_launch(session: Session, job: Job, *, actor: Actor | str) -> bool:
    """Move a job admitted while the cluster (Kueue) held its launch to ``running``: its
    trainer started. Whichever sees it first -- the executor (the pod runs) or the
    report endpoint (the trainer reports) -- calls this; False when there was nothing to
    start (the job is not waiting, or the other one was first)."""
    if job.status != "queued" or job.awaiting_start_since is None:
        return False
    transition(session, job, "running", actor=actor, queue_reason=None,
               message="Kueue started the Job: the trainer is running.")
    return True


def add_event(
    session: Session,
    job: Job,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
    created_at: Any = None,
) -> JobEvent:
    """Append a ``fine_tuning.job.event`` (not a status change) to ``job``."""
    event = JobEvent(**event_values(job.id, message, level=level, type=type, data=data, created_at=created_at))
    session.add(event)
    return event


def event_values(
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
    created_at: Any = None,
) -> dict[str, Any]:
    """The columns of a new ``fine_tuning.job.event`` row: ``add_event``'s, or one row of a
    multi-row insert (the scheduler writes thousands of waiting reasons per cycle).

    Raises:
        ValueError: ``level`` or ``type`` is not one of ``EVENT_LEVELS`` / ``EVENT_TYPES``.
    """
    if level not in EVENT_LEVELS or type not in EVENT_TYPES:
        raise ValueError(f"event level {level!r} / type {type!r}: expected one of {EVENT_LEVELS} / {EVENT_TYPES}")
    return {"id": new_id("ftevent"), "job_id": job_id, "message": message, "level": level, "type": type,
            "data": data, "created_at": created_at or utcnow()}


def lock_job(session: Session, job_id: str) -> Job | None:
    """Load a job for an update that must not race (row lock on PostgreSQL, write lock on SQLite)."""
    begin_write(session)
    return session.scalar(select(Job).where(Job.id == job_id).with_for_update())
