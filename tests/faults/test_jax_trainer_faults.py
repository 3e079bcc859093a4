"""The JAX trainer (``jax_lora`` on the local CPU pool) killed or stopped mid-run, in
production mode (PostgreSQL, Redis, Celery worker, scheduler; ``tests.faults.production``).

- ``kill -9``: a lost run; the job is requeued as a restart (after the restart backoff)
  and its next run resumes from its latest checkpoint (the epoch's, step 8 of 16).
- SIGTERM from outside (a node shutting down): the trainer checkpoints at the step it
  is at, the job is requeued (not counted as a restart) and its next run resumes there,
  mid-epoch.

Either way every metric step is reported once (the API, the results file and the
``metrics.jsonl`` output), and the loss after the fault is the uninterrupted run's, in
fp32, to 1e-6: the restored adapter, optimizer state, data cursor and RNG are exact.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import httpx
import pytest

from tests.e2e.test_local_training import (
    all_metrics,
    assert_contiguous,
    assert_results_file_matches,
)
from tests.faults.production import (
    ProductionStack,
    events,
    finished,
    losses,
    output_metric_steps,
    stop_trainer_when,
    submit,
    upload_examples,
)

STEPS = 16  # 32 examples, batch 4, 2 epochs: checkpoints at steps 8 and 16
FAULT_AFTER_STEP = 9  # past the first checkpoint, well before the end


@pytest.fixture(scope="module")
def jax_file(production: ProductionStack) -> str:
    with production.http() as http:
        return upload_examples(http, n=32, seed=5)


@pytest.fixture(scope="module")
def reference(production: ProductionStack, jax_file: str) -> dict[int, float]:
    """The uninterrupted run's loss by step."""
    with production.http() as http:
        done = finished(http, _jax_job(http, jax_file))
        assert done["status"] == "succeeded", (done["error"], production.service.dump_logs())
        assert done["restarts"] == 0
        curve = losses(http, done["id"])
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


def _jax_job(http: httpx.Client, file_id: str) -> str:
    return submit(http, file_id, trainer="jax_lora", n_epochs=2, batch_size=4, seed=21)


def _signal_trainer_after(stack: ProductionStack, job_id: str, step: int, sig: int) -> int:
    """Send ``sig`` to the trainer's process group once its ``metrics.jsonl`` shows ``step``
    (the file is written at each step, the API hears of it up to a flush later); returns
    the last step the trainer had written then."""
    def written() -> list[int]:
        try:
            return output_metric_steps(stack.data_dir, job_id)
        except (FileNotFoundError, ValueError):  # not there yet, or a line half written
            return []

    pid = stop_trainer_when(stack.data_dir, job_id, lambda: len(written()) >= step, f"step {step} of {job_id}")
    at = max(written())
    os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError):  # gone already after a SIGKILL
        os.killpg(pid, signal.SIGCONT)  # a SIGTERM is handled once the trainer runs again
    return at


def _run_with_fault(stack: ProductionStack, http: httpx.Client, file_id: str, sig: int,
                    reference: dict[int, float]) -> tuple[dict[str, Any], list[str], int]:
    """A job whose trainer gets ``sig`` past the first checkpoint: it succeeds with every
    step reported once and the uninterrupted loss. Returns the job, its events and the last
    step the trainer had written when signalled."""
    job_id = _jax_job(http, file_id)
    signalled_at = _signal_trainer_after(stack, job_id, FAULT_AFTER_STEP, sig)
    assert signalled_at < STEPS, f"the trainer finished before the signal ({signalled_at})"
    done = finished(http, job_id)
    assert done["status"] == "succeeded", (done["error"], stack.service.dump_logs())
    rows = all_metrics(http, job_id)
    assert_contiguous(rows, STEPS)
    assert_results_file_matches(http, done, rows)
    assert output_metric_steps(stack.data_dir, job_id) == list(range(1, STEPS + 1))
    resumed = losses(http, job_id)
    assert sorted(resumed) == sorted(reference)
    for step in sorted(reference):
        assert abs(resumed[step] - reference[step]) <= 1e-6, (
            f"step {step}: resumed {resumed[step]} vs uninterrupted {reference[step]}")
    return done, events(http, job_id), signalled_at


def test_a_killed_jax_trainer_resumes_from_its_last_checkpoint_on_the_same_curve(
    stack: ProductionStack, jax_file: str, reference: dict[int, float]
) -> None:
    with stack.http() as http:
        done, messages, _ = _run_with_fault(stack, http, jax_file, signal.SIGKILL, reference)
    assert done["restarts"] == 1
    assert any(m.startswith("trainer killed by SIGKILL (restart 1 of 2); resumes from ") and "step-8" in m
               for m in messages), messages
    assert "jax_lora: model loaded, resuming at step 8" in messages, messages
    # The supervisor restarts nothing itself: the requeued job is admitted again, as attempt 2.
    assert sum(m.startswith("Admitted on pool") for m in messages) == 2, messages


def test_sigterm_checkpoints_requeues_and_resumes_the_jax_trainer_mid_epoch(
    stack: ProductionStack, jax_file: str, reference: dict[int, float]
) -> None:
    with stack.http() as http:
        done, messages, stopped_at = _run_with_fault(stack, http, jax_file, signal.SIGTERM, reference)
        checkpoints = http.get(f"/fine_tuning/jobs/{done['id']}/checkpoints").json()["data"]
    assert done["restarts"] == 0, "a stop from outside is not a crash"
    (preempted,) = [m for m in messages if m.startswith("preempted (SIGTERM) at step ")]
    step = int(preempted.split(" at step ")[1].split(";")[0])
    assert FAULT_AFTER_STEP <= stopped_at <= step < STEPS, (stopped_at, preempted)
    assert any(m.startswith("The trainer was stopped from outside") and f"step-{step}" in m
               for m in messages), messages
    assert f"jax_lora: model loaded, resuming at step {step}" in messages, messages
    assert sum(m.startswith("Admitted on pool") for m in messages) == 2, messages
    assert step in {c["step_number"] for c in checkpoints}, checkpoints
