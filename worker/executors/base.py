"""The Executor protocol: how the scheduling cycle starts, stops and observes trainers.

Two implementations: ``worker.executors.local`` (trainer subprocesses on this machine)
and ``worker.executors.kubernetes`` (a batch/v1 Job per job on a node pool). The cycle
only ever talks to this protocol, so its tests can inject a recording fake.

Semantics every executor keeps:

- ``launch`` is idempotent per job id: launching a job that is already launched is a
  no-op (Celery tasks and scheduler replicas may retry).
- ``stop`` sends SIGTERM semantics: the trainer checkpoints and exits with
  ``ExitCode.PREEMPTED``; *why* it was stopped (cancel / pause / preempt) decides the
  job's next status, which the executor reports back through ``reconcile``.
- ``snapshot`` returns the capacity the scheduler may place on.
- ``reconcile`` returns what changed since the last call (a trainer exited, a pod could
  not be scheduled, an image could not be pulled ...), as plain values; the caller turns
  them into job transitions through ``control.jobs.lifecycle.transition``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from scheduling.capacity import CapacitySnapshot, HeldGpus

if TYPE_CHECKING:
    from scheduling.placement import Placement
    from trainers.spec import TrainerSpec


class StopReason(str, enum.Enum):
    """Why a running trainer is being stopped; decides the job's status after it exits."""

    CANCEL = "cancel"  # -> cancelled
    PAUSE = "pause"  # -> paused (resume_from = last checkpoint)
    PREEMPT = "preempt"  # -> queued (resume_from = last checkpoint)


class ObservedKind(str, enum.Enum):
    """What an executor observed about a job."""

    STARTED = "started"  # the trainer process / pod is running
    WAITING = "waiting"  # launched but not running yet (e.g. Pending: Unschedulable)
    SUCCEEDED = "succeeded"  # exit 0
    FAILED = "failed"  # a terminal failure: error_code/message say why
    STOPPED = "stopped"  # exited after stop(): see stop_reason
    RETRYING = "retrying"  # a transient failure; the executor restarts it itself (an event only)
    REQUEUE = "requeue"  # the run was lost (evicted, node lost, crashed, never scheduled):
    # requeue the job from its last checkpoint; counts as a restart (the store caps them)


@dataclass(frozen=True)
class ObservedChange:
    """One state change an executor observed for a job (``reconcile`` returns these)."""

    job_id: str
    kind: ObservedKind
    message: str = ""
    error_code: str | None = None
    exit_code: int | None = None
    stop_reason: StopReason | None = None
    checkpoint: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    attempt: int | None = None
    """The run attempt (``jobs.attempt``) this change is about; a change of an older attempt
    than the job's current one never moves the job. None: the executor cannot tell."""


def restart_delay_s(restart: int, *, base_s: float, max_s: float) -> float:
    """Seconds before restart number ``restart`` (1, 2, ...) of a lost run: ``base_s``,
    then doubling, at most ``max_s``. Every executor waits this long before it starts a
    crashed run again, so a fault that outlives one attempt does not use up the restarts."""
    if restart < 1 or base_s <= 0:
        return 0.0
    return min(base_s * 2.0 ** min(restart - 1, 32), max_s)


@runtime_checkable
class JobRef(Protocol):
    """The least an executor needs to know about a job row (``control.db.models`` job)."""

    id: str


@runtime_checkable
class Executor(Protocol):
    """Starts, stops and observes trainers; the scheduling cycle's only I/O to compute."""

    def launch(self, job: JobRef, spec: TrainerSpec, placement: Placement) -> None:
        """Start the trainer for ``job`` on the placement's pool/nodes (all GPUs at once)."""
        ...

    def stop(self, job: JobRef, reason: StopReason) -> None:
        """SIGTERM the trainer: it checkpoints and exits; ``reason`` decides what follows."""
        ...

    def snapshot(self) -> CapacitySnapshot:
        """Nodes per pool with free GPUs, and the jobs holding GPUs now."""
        ...

    def reconcile(self) -> list[ObservedChange]:
        """What changed since the last call (exits, scheduling problems, retries)."""
        ...


# A job the database has ``running`` (``DbStore.running_jobs``): what an executor that
# outlives its launches (Kubernetes) matches its cluster objects against. The same value
# the capacity views pack onto nodes (``CapacitySnapshot.packed``).
RunningRow = HeldGpus
