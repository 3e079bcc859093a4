"""What keeps ``tunefleet serve``'s children running: the Celery worker, the scheduler loop
and the inference worker.

A child that exits -- it crashed, was killed, ran out of memory -- is started again after a
backoff: ``backoff_s`` (1 s), doubling with each restart up to ``max_backoff_s`` (30 s),
and back to ``backoff_s`` once the child has run ``stable_s`` (60 s). A child with a health
probe (the inference worker: its ``/healthz``, which also reports a generation stalled on
its model) that fails ``probe_failures`` (3) probes in a row, ``probe_interval_s`` (5 s)
apart, is killed (SIGKILL: a wedged process may ignore SIGTERM) and so restarted the same
way; probes count once the child has answered one, or ``startup_s`` (300 s) after its
start. Every exit and restart is logged (``tunefleet.serve``, WARNING).

Children end with ``serve``: each sets ``PR_SET_PDEATHSIG`` itself as the first thing its
command does (:func:`die_with_parent`), then exits if ``serve`` is already gone, so a
``serve`` killed by SIGKILL still takes them along. That is done in the child rather than
in a ``preexec_fn``, which is unsafe in a process with threads, as this one is once it
restarts children from its monitor thread.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("tunefleet.serve")

PARENT_ENV = "TUNEFLEET_SUPERVISOR_PID"


def die_with_parent() -> None:
    """In a child of :class:`Supervisor`: get SIGTERM when it dies (Linux), and exit at once
    if it died before this ran."""
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(expected):
        raise SystemExit(1)


@dataclass(frozen=True)
class ChildSpec:
    """One child: its ``name`` in the log, its ``command``, inherited file descriptors, and an
    optional health probe (True: healthy)."""

    name: str
    command: Sequence[str]
    pass_fds: tuple[int, ...] = ()
    healthy: Callable[[], bool] | None = None


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    failures: int = 0
    answered: bool = False
    next_probe: float = 0.0
    history: list[int] = field(default_factory=list)  # pids, oldest first


class Supervisor:
    """Starts the children and keeps them running (see the module doc) until :meth:`stop`."""

    def __init__(self, specs: Sequence[ChildSpec], *, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 stable_s: float = 60.0, check_interval_s: float = 1.0, probe_interval_s: float = 5.0,
                 probe_failures: int = 3, startup_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.check_interval_s, self.probe_interval_s = check_interval_s, probe_interval_s
        self.probe_failures, self.startup_s = probe_failures, startup_s
        self._clock = clock
        self._children = [_Child(spec, backoff_s=backoff_s) for spec in specs]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="supervise children", daemon=True)

    def start(self) -> None:
        for child in self._children:
            self._spawn(child)
        self._monitor.start()

    def pids(self) -> dict[str, list[int]]:
        """Every process each child has had, oldest first."""
        with self._lock:
            return {c.spec.name: list(c.history) for c in self._children}

    def stop(self, grace_s: float = 10.0) -> None:
        """No more restarts; SIGTERM every child, SIGKILL what still runs after ``grace_s``."""
        self._stopping.set()
        if self._monitor.is_alive():
            self._monitor.join()
        running = [c.proc for c in self._children if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, child: _Child) -> None:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen(list(child.spec.command), pass_fds=child.spec.pass_fds, env=env)
        now = self._clock()
        with self._lock:
            child.proc, child.started_at, child.history = proc, now, [*child.history, proc.pid]
            child.failures, child.answered, child.next_probe = 0, False, now + self.probe_interval_s

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_interval_s):
            for child in self._children:
                if self._stopping.is_set():
                    return
                self._check(child)

    def _check(self, child: _Child) -> None:
        now = self._clock()
        if child.proc is None:
            if now >= child.restart_at:
                self._spawn(child)
            return
        code = child.proc.poll()
        if code is not None:
            self._exited(child, code, now)
        elif child.spec.healthy is not None and now >= child.next_probe:
            child.next_probe = now + self.probe_interval_s
            self._probe(child, now)

    def _exited(self, child: _Child, code: int, now: float) -> None:
        if now - child.started_at >= self.stable_s:
            child.backoff_s = self.backoff_s  # it ran well: a new failure starts the backoff over
        how = f"signal {-code}" if code < 0 else f"code {code}"
        child.restarts += 1
        log.warning("%s (pid %d) exited with %s; restarting it in %.0f s (restart %d)", child.spec.name,
                    child.proc.pid if child.proc else -1, how, child.backoff_s, child.restarts)
        with self._lock:
            child.proc = None
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, self.max_backoff_s)

    def _probe(self, child: _Child, now: float) -> None:
        assert child.spec.healthy is not None and child.proc is not None
        if child.spec.healthy():
            child.answered, child.failures = True, 0
            return
        if not child.answered and now - child.started_at < self.startup_s:
            return  # still starting (the inference worker imports torch first)
        child.failures += 1
        if child.failures >= self.probe_failures:
            log.warning("%s (pid %d) failed %d health checks in a row; killing it", child.spec.name,
                        child.proc.pid, child.failures)
            child.proc.kill()
