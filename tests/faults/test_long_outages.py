"""PostgreSQL or Redis away for 30 s while a job trains, in production mode
(``tests.faults.production``: the test owns both servers).

Longer than every retry that hides a blip: the trainer's reports back off and spool,
the supervising task keeps watching the trainer and retries its final write, the
scheduler's cycles fail until the backend is back, the Celery worker reconnects (a
restarted Redis comes back empty: every queued message is gone). Afterwards the job
that ran through it and a job created just before it both succeed, with every metric
step and every report batch applied exactly once, no process of the service died, and
the trainer was never restarted.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_local_training import assert_contiguous
from tests.faults import production
from tests.faults.production import ProductionStack, wait_until

OUTAGE_S = 30.0
STEPS = 32  # 64 examples, batch 4, 2 epochs


def _report_seqs(stack: ProductionStack, job_id: str) -> list[int]:
    return [seq for (seq,) in production.pg_rows(
        stack, "SELECT seq FROM report_batches WHERE job_id = %s ORDER BY seq", job_id)]


@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_a_30_s_backend_outage_mid_run_loses_nothing_and_strands_no_job(stack: ProductionStack,
                                                                         backend: str) -> None:
    server = stack.postgres if backend == "postgres" else stack.redis
    with stack.tenant_http(f"outage-{backend}") as http:
        file_id = production.upload_examples(http, n=64, seed=13)
        running = production.submit(http, file_id, n_epochs=2, batch_size=4)
        wait_until(production.step_reached(http, running, 2), 300, "the first job's step 2")
        waiting = production.submit(http, file_id, n_epochs=1, batch_size=4)  # queued behind it
        server.stop()
        time.sleep(OUTAGE_S)
        server.start()

        for job_id, steps in ((running, STEPS), (waiting, STEPS // 2)):
            done = production.finished(http, job_id, timeout=300)
            assert done["status"] == "succeeded", (job_id, done["error"], stack.service.dump_logs())
            assert done["restarts"] == 0, done
            assert_contiguous(production.all_metrics(http, job_id), steps)
            assert production.output_metric_steps(stack.data_dir, job_id) == list(range(1, steps + 1))
            seqs = _report_seqs(stack, job_id)
            assert seqs == list(range(1, len(seqs) + 1)), f"report batch seqs of {job_id}: {seqs}"
            messages = production.events(http, job_id)
            assert sum(m.startswith("Admitted on pool") for m in messages) == 1, messages
            assert sum(m.startswith("training finished after ") for m in messages) == 1, messages
    assert stack.supervisors_alive() == {"api": None, "worker": None, "scheduler": None}
