"""Pause, resume and cancel issued within 100 ms of each other, with the trainer held in
one phase of its run: loading the model, stepping, or writing a checkpoint.

The service runs as in production (PostgreSQL, Redis, a Celery worker, the scheduler
loop, trainer subprocesses of the local executor). To land the calls in a phase, every
trainer process starts with ``sitecustomize.py`` of a hold folder on its ``PYTHONPATH``
(the local executor passes ``PYTHONPATH`` on): it wraps one function of the PyTorch
recipe, and the FIRST trainer of a job that reaches it writes ``<job>.entered`` and
waits there until both the stop it asked for arrived (SIGTERM sets the trainer's stop
flag) and the test released it (``<job>.release``, written once every call of the
sequence has been answered). The run then carries on as it would have: the step or the
checkpoint it was in completes, and the trainer stops at the next step boundary.

The contract, checked on every row:

- every call answers as the lifecycle allows it (a resume or pause of a cancelled job
  is refused with 409), and the job ends in the row's status;
- no false success: a succeeded job has each step's metrics exactly once;
- cancel wins over a pending resume: the cancelled job never runs again (one
  admission), its trainer is gone and it stays cancelled after the old run's exit;
- pause then resume at once resumes from the checkpoint the pause wrote (from the start
  when the pause came before the first step): the old attempt's exit never ends the
  new attempt.

All rows run at once on one service with three trainer slots: the table costs about a
third of its rows' trainer starts, not their sum.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO
from tests.e2e.conftest import Service, service, tiny_model_dir  # noqa: F401 (fixtures)
from tests.e2e.test_local_training import (
    all_metrics,
    assert_contiguous,
    create_job,
    upload,
    wait_for,
    wait_status,
)
from tunefleet.demo import demo_examples

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

TERMINAL = {"succeeded", "failed", "cancelled"}
# 16 examples, batch 4, 2 epochs: 8 steps, a checkpoint every 4 (one per epoch).
EXAMPLES, BATCH, EPOCHS, TOTAL_STEPS, CHECKPOINT_EVERY = 16, 4, 2, 8, 4
HOLD_STEP = 1  # 0-based: the trainer is held inside its 2nd step
HOLD_TIMEOUT_S = 90.0
# Nine rows share three trainer slots, so a row's job can queue behind two rounds of other
# rows' runs (most of them started twice) before it is admitted; on a loaded 2-core machine
# that took longer than five minutes. The queue wait and the trainer's own start are bounded
# apart, so a slow queue is not reported as a trainer that never reached its phase.
QUEUE_TIMEOUT_S, ENTER_TIMEOUT_S = 900.0, 300.0

# The hold folder's sitecustomize.py: only a trainer process (``python -m trainers``) loads the hook.
SITECUSTOMIZE = """\
import sys
if sys.orig_argv[1:3] == ["-m", "trainers"]:
    sys.path.insert(0, {repo!r})
    from tests.faults.test_interleavings import hold_in_phase
    hold_in_phase({folder!r})
"""


def hold_in_phase(folder: str) -> None:
    """Wrap the recipe function of the phase ``<folder>/<job>.json`` names (runs in the trainer)."""
    argv = sys.orig_argv
    spec = json.loads(Path(argv[argv.index("--spec") + 1]).read_text(encoding="utf-8"))
    hold = Hold(Path(folder), spec["job_id"])
    if not hold.config_path.exists():
        return
    from trainers.fsdp_qlora import recipe

    phase = json.loads(hold.config_path.read_text(encoding="utf-8"))["phase"]
    if phase == "loading":
        build_model = recipe.build_model

        def held_build_model(*args, **kwargs):
            built = build_model(*args, **kwargs)
            hold.wait("loading")
            return built

        recipe.build_model = held_build_model
    elif phase == "stepping":
        train_step = recipe.train_step

        def held_train_step(*args, **kwargs):
            stats = train_step(*args, **kwargs)
            if kwargs["step"] == HOLD_STEP:
                hold.wait("stepping")
            return stats

        recipe.train_step = held_train_step
    elif phase == "checkpoint":
        save = recipe.save_checkpoint_distributed

        def held_save(*args, write_adapter, **kwargs):
            def held_write(directory: Path) -> None:  # the checkpoint's temporary folder
                write_adapter(directory)
                hold.wait("checkpoint")

            return save(*args, write_adapter=held_write, **kwargs)

        recipe.save_checkpoint_distributed = held_save


@dataclass
class Hold:
    """The files through which a test holds and releases the trainer of ``job_id``."""

    folder: Path
    job_id: str

    @property
    def config_path(self) -> Path:
        return self.folder / f"{self.job_id}.json"

    @property
    def entered_path(self) -> Path:
        return self.folder / f"{self.job_id}.entered"

    @property
    def release_path(self) -> Path:
        return self.folder / f"{self.job_id}.release"

    def wait(self, phase: str) -> None:
        """Hold the first trainer of the job that gets here; later ones (a resumed attempt) pass."""
        try:
            os.close(os.open(self.folder / f"{self.job_id}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        self.entered_path.write_text(phase)
        # The trainer's SIGTERM handler is a bound method of its StopFlag.
        stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.release_path.exists() and (stop is None or stop.requested):
                return
            time.sleep(0.02)


@dataclass(frozen=True)
class Row:
    sequence: tuple[str, ...]
    phase: str
    answers: tuple[int, ...]  # HTTP status of each call
    final: str


SEQUENCES = {
    ("pause", "resume"): ((200, 200), "succeeded"),
    ("pause", "resume", "cancel"): ((200, 200, 200), "cancelled"),
    ("pause", "cancel", "resume"): ((200, 200, 409), "cancelled"),
}
PHASES = ("loading", "stepping", "checkpoint")
TABLE = [Row(seq, phase, answers, final) for seq, (answers, final) in SEQUENCES.items() for phase in PHASES]


def _pools_file(path: Path, slots: int) -> Path:
    path.write_text(yaml.safe_dump({"pools": [{
        "name": "local", "accelerator": "cpu", "gpu_memory_gib": 16, "gpus_per_node": slots,
        "trainers": ["fsdp_qlora"], "peak_tflops": 0.5, "nodes": 1}]}))
    return path


def _messages(http: httpx.Client, job_id: str) -> list[str]:
    data = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(data)]


def _admitted(http: httpx.Client, job_id: str) -> bool:
    return any(m.startswith("Admitted on pool") for m in _messages(http, job_id))


def _run_row(svc: Service, folder: Path, file_id: str, row: Row) -> str | None:
    """Play one row; None when the contract held, else what broke (with the job's events)."""
    with svc.http() as http:
        job = create_job(http, file_id, n_epochs=EPOCHS, batch_size=BATCH, seed=11)
        hold = Hold(folder, job["id"])
        hold.config_path.write_text(json.dumps({"phase": row.phase}))
        try:
            wait_for(lambda: hold.entered_path.exists() or _admitted(http, job["id"]), QUEUE_TIMEOUT_S,
                     "the job to leave the queue", interval=1.0)
            wait_for(hold.entered_path.exists, ENTER_TIMEOUT_S, "the admitted trainer to enter its phase")
            answers = []
            for call in row.sequence:
                answers.append(http.post(f"/fine_tuning/jobs/{job['id']}/{call}").status_code)
            hold.release_path.write_text("go")
            problems = _check(svc, http, job["id"], row, tuple(answers))
        except AssertionError as exc:  # a wait that timed out
            problems = str(exc)
        if problems:
            return f"{row} ({job['id']}): {problems}\n  events: {_messages(http, job['id'])}"
    return None


def _check(svc: Service, http: httpx.Client, job_id: str, row: Row, answers: tuple[int, ...]) -> str | None:
    if answers != row.answers:
        return f"answers {answers}, expected {row.answers}"
    done = wait_status(http, job_id, TERMINAL, timeout=240)
    if done["status"] != row.final:
        return f"ended {done['status']} ({done.get('error')}), expected {row.final}"
    pid_file = svc.data_dir / "jobs" / job_id / "trainer.pid"
    wait_for(lambda: not pid_file.exists(), 60, f"the trainer of {job_id} to end")
    messages = _messages(http, job_id)
    admissions = sum(m.startswith("Admitted on pool") for m in messages)
    if row.final == "cancelled":
        time.sleep(1.5)  # a few scheduler cycles: a pending resume must not start a run now
        again = http.get(f"/fine_tuning/jobs/{job_id}").json()
        if again["status"] != "cancelled" or admissions != 1:
            return f"cancelled job is {again['status']} after {admissions} admissions"
        return None
    rows = all_metrics(http, job_id)
    if [r["step"] for r in rows] != list(range(1, TOTAL_STEPS + 1)):
        return f"metric steps {[r['step'] for r in rows]}, expected 1..{TOTAL_STEPS} once each"
    if admissions != 2:
        return f"{admissions} admissions, expected the first run and the resumed one"
    resumed = [m for m in messages if m.startswith("resumed from ")]
    expected = {"loading": [], "stepping": [f"resumed from step-{HOLD_STEP + 1}"],
                "checkpoint": [f"resumed from step-{CHECKPOINT_EVERY}"]}[row.phase]
    if resumed != expected:
        return f"the resumed run says {resumed}, expected {expected} (the checkpoint the pause wrote)"
    assert_contiguous(rows, done["total_steps"])
    return None


def test_pause_resume_cancel_interleavings_in_every_phase(service, tmp_path) -> None:  # noqa: F811
    folder = tmp_path / "hold"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(repo=str(REPO), folder=str(folder)))
    svc = service("postgres", PYTHONPATH=os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p),
                  TUNEFLEET_NODE_POOLS_FILE=str(_pools_file(tmp_path / "pools.yaml", slots=3)))
    with svc.http() as http:
        file_id = upload(http, demo_examples(EXAMPLES, seed=6))
    with ThreadPoolExecutor(max_workers=len(TABLE)) as pool:
        results = list(pool.map(lambda row: _run_row(svc, folder, file_id, row), TABLE))
    failures = [r for r in results if r is not None]
    assert not failures, "\n".join(failures)
