"""Supervising one trainer process on this machine (the heart of the local executor).

`supervise_trainer` starts ``python -m trainers --spec spec.json`` as a child process in
its own session (so a whole process tree can be signalled), appends its output to the
job's log file, and watches it until it ends -- once: it never restarts a trainer itself.

- the service wants it stopped (cancel, pause, preemption — `should_stop()` turns true):
  SIGTERM, which the trainer answers by checkpointing and exiting with PREEMPTED; after
  `grace_s` seconds, SIGKILL;
- it dies of a crash (INTERNAL_ERROR, an exit code outside the contract, a signal such as
  ``kill -9``): the outcome is `crashed`, and the caller reports a lost run (REQUEUE) to
  ``worker.outcomes.apply_outcome``, which counts the restart, applies the backoff and
  fails the job past ``max_restarts`` -- as it does for a Kubernetes pod;
- it ends with SUCCESS, USER_ERROR or OUT_OF_MEMORY: the outcome says why.

It knows nothing of the database: the caller (``worker.executors.local.supervisor``, the
body of the Celery task) turns the returned `TrainerOutcome` into an ``ObservedChange``.
The pid is written to the job directory so that a worker that was killed and got the task again can stop an orphaned
trainer before starting a new one; `supervision_lock` makes sure only one supervisor
watches a job at a time (a task delivered twice must not start a second trainer).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainers.common.private_files import (
    PRIVATE_FILE_MODE,
    open_private_log,
    private_dir,
    write_private_text,
)
from trainers.exit_codes import ExitCode

log = logging.getLogger(__name__)

_RESTARTABLE = {ExitCode.INTERNAL_ERROR}


@dataclass
class TrainerOutcome:
    """How a supervised trainer run ended."""

    returncode: int
    stopped: bool = False  # ended because should_stop() asked for it
    error: dict[str, str] | None = None  # {"code", "message"} from the termination log

    @property
    def succeeded(self) -> bool:
        return self.returncode == ExitCode.SUCCESS

    @property
    def crashed(self) -> bool:
        """Lost through no decision of the trainer's: a crash, a signal (``kill -9``, the
        kernel's OOM killer) or an exit code outside the contract. Such a run is worth
        resuming from its checkpoint; a user error or GPU out-of-memory exit is not."""
        if self.stopped:
            return False
        code = self.returncode
        return code < 0 or code in _RESTARTABLE or code not in set(ExitCode)


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL``, ``exit 1 (INTERNAL_ERROR)``, ``exit 7``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    try:
        return f"exit {returncode} ({ExitCode(returncode).name})"
    except ValueError:
        return f"exit {returncode}"


def _read_termination(path: Path) -> dict[str, str] | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not text:
        return None
    try:
        data = json.loads(text.splitlines()[-1])
    except json.JSONDecodeError:
        return {"code": "trainer_error", "message": text[-2000:]}
    if isinstance(data, dict) and "code" in data:
        return {"code": str(data["code"]), "message": str(data.get("message", ""))}
    return None


@contextmanager
def supervision_lock(job_dir: Path, wait_s: float = 10.0) -> Iterator[bool]:
    """Hold the job's supervisor lock (``flock`` on ``supervisor.lock``) for the block.

    Yields False when a live supervisor (another worker thread or process) still holds
    it after `wait_s`: a task delivered twice leaves the running trainer alone, while a
    job re-admitted right after its previous run ended waits the moment that run's
    supervisor needs to finish. The kernel drops the lock when its holder dies, so a
    worker killed mid-job never blocks the one that takes over. The descriptor is not
    inherited by the trainer (PEP 446).
    """
    private_dir(job_dir)
    fd = os.open(job_dir / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def supervised(job_dir: Path) -> bool:
    """Whether a live supervisor holds the job's lock right now (a probe that never waits).

    The kernel drops a dead supervisor's lock at once, so a free lock means no process
    watches the job's trainer: a worker killed mid-run shows here the moment it dies.
    """
    try:
        fd = os.open(job_dir / "supervisor.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor releases a lock the probe took
    return False


def kill_orphan(pid_file: Path, grace_s: float = 10.0) -> bool:
    """Stop a trainer left running by a supervisor that died. Returns True if one was found."""
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return False
    except PermissionError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pid_file.unlink(missing_ok=True)
    return True


# glibc's malloc serves XLA:CPU's ~100 MB per-step temp buffer from fresh mmapped chunks,
# so the kernel faults in ~24,000 4 KiB pages on every train step. With transparent huge
# pages for malloc (THP mode "madvise" suffices) it takes ~250: the JAX trainer's step
# (bench shape, 2 host devices) went from ~550 to ~440 ms of CPU time, peak RSS +1 %
# (bench/RESULTS.md, "jax_lora as shipped on a CPU-only local pool"). Only the JAX
# trainer gets it: the torch trainer's memory checks measure RSS, which huge pages round up.
JAX_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def trainer_env(trainer: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables a trainer family gets on top of the worker's environment.

    The JAX trainer gets ``JAX_MALLOC_TUNABLE`` appended to ``GLIBC_TUNABLES`` (glibc
    reads it at process start, so it has to be in the environment the trainer starts with).
    """
    if trainer != "jax_lora":
        return {}
    current = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in current:
        return {}  # the operator chose a value already
    return {"GLIBC_TUNABLES": ":".join(t for t in (current, JAX_MALLOC_TUNABLE) if t)}


# What a local trainer inherits from the worker: the control plane's environment holds its
# secret key, database and broker URLs and the admin key, none of which a trainer (running
# tenant data through third-party libraries) needs. Exact names, then name prefixes.
TRAINER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "GLIBC_TUNABLES", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    # The trainer's own settings (trainers/): S3 endpoint, staging cache, tracker allow-list.
    "TUNEFLEET_S3_ENDPOINT_URL", "TUNEFLEET_CACHE_DIR", "TUNEFLEET_TRACKER_ALLOWED_HOSTS",
    "TUNEFLEET_STOP_WITH_PARENT",
})
TRAINER_ENV_PREFIXES = (
    "LC_", "JAX_", "TF_CPP_", "TORCH_", "PYTORCH_", "NCCL_", "NVIDIA_", "CUDA_", "HF_",
    "TRANSFORMERS_", "AWS_",  # the artifact store's credentials: outputs go to the bucket
    "MLFLOW_", "WANDB_",  # the operator's tracker credentials (trainers/common/integrations.py)
)


def trainer_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the worker's environment a local trainer gets (an allow-list)."""
    return {name: value for name, value in environ.items()
            if name in TRAINER_ENV_NAMES or name.startswith(TRAINER_ENV_PREFIXES)}


def _spec_trainer(spec_path: Path) -> str:
    try:
        return str(json.loads(spec_path.read_text(encoding="utf-8")).get("trainer", ""))
    except (OSError, json.JSONDecodeError):
        return ""  # the trainer reports an unreadable spec itself (invalid_spec)


def supervise_trainer(
    spec_path: Path,
    *,
    log_path: Path,
    termination_path: Path,
    pid_path: Path,
    should_stop: Callable[[], bool],
    heartbeat_path: Path | None = None,
    grace_s: float = 30.0,
    poll_s: float = 0.25,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> TrainerOutcome:
    """Run the trainer of `spec_path` once, until it ends (see the module docstring)."""
    private_dir(log_path.parent)
    child_env = {**trainer_base_env(os.environ), **trainer_env(_spec_trainer(spec_path)), **(env or {})}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    termination_path.unlink(missing_ok=True)
    with open_private_log(log_path) as log_file:
        proc = subprocess.Popen(
            [python, "-m", "trainers", "--spec", str(spec_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
    write_private_text(pid_path, str(proc.pid))
    stopped = _wait(proc, should_stop=should_stop, grace_s=grace_s, poll_s=poll_s,
                    heartbeat_path=heartbeat_path)
    pid_path.unlink(missing_ok=True)
    returncode = proc.returncode
    if returncode == ExitCode.PREEMPTED:
        # Without a stop asked here the process got SIGTERM from outside (a shutdown): it
        # checkpointed and stopped all the same, which is no crash.
        stopped = True
    return TrainerOutcome(returncode, stopped=stopped, error=_read_termination(termination_path))


def _wait(proc: subprocess.Popen, *, should_stop: Callable[[], bool], grace_s: float, poll_s: float,
          heartbeat_path: Path | None = None) -> bool:
    """Wait for `proc`; SIGTERM then SIGKILL its process group once should_stop() is true.

    Touches `heartbeat_path` on every poll: the executor restarts supervision of a job
    whose heartbeat went stale (the worker running this loop died).
    """
    stop_sent_at: float | None = None
    while True:
        if heartbeat_path is not None:
            heartbeat_path.touch(mode=PRIVATE_FILE_MODE)
        try:
            proc.wait(timeout=poll_s)
            return stop_sent_at is not None
        except subprocess.TimeoutExpired:
            pass
        if stop_sent_at is None:
            if should_stop():
                stop_sent_at = time.monotonic()
                _signal_group(proc, signal.SIGTERM)
        elif time.monotonic() - stop_sent_at > grace_s:
            log.warning("trainer pid %s ignored SIGTERM for %.0fs; killing", proc.pid, grace_s)
            _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
