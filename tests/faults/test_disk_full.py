"""The disk fills up while the trainer writes a checkpoint, or its outputs, in production
mode (``tests.faults.production``; the job directories and the artifact directory are
small tmpfs mounts, filled to the last byte at a chosen step).

A full disk is not a crash that a restart could fix: the job must fail at once, with the
stable code ``disk_full`` and a message saying so, instead of staying ``running``,
being restarted into the same wall, or succeeding without its outputs. What the service
had acknowledged before (metric steps, the checkpoint it listed) must still be there.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.faults import production
from tests.faults.production import ProductionStack, wait_until

FIRST_CHECKPOINT = 16  # 64 examples, batch 4, 2 epochs: checkpoints at steps 16 and 32


def _listed_checkpoints(http: httpx.Client, job_id: str) -> list[int]:
    return [c["step_number"] for c in http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]]


def _output_steps(stack: ProductionStack, job_id: str) -> list[int]:
    try:
        return production.output_metric_steps(stack.data_dir, job_id)
    except (FileNotFoundError, ValueError):
        return []


@pytest.mark.parametrize(("full", "trainer"), [
    ("jobs", "fsdp_qlora"),  # torch's distributed checkpoint wraps the OSError in its own exception
    ("jobs", "jax_lora"),  # safetensors (Rust) names the OS error only in its message
    ("artifacts", "fsdp_qlora"),
])
def test_a_full_disk_fails_the_job_with_disk_full_and_keeps_what_was_acknowledged(
    stack: ProductionStack, full: str, trainer: str
) -> None:
    disk = stack.disks[full]
    disk.require()
    with stack.tenant_http(f"disk-{full}") as http:
        file_id = production.upload_examples(http, n=64, seed=9)
        job_id = production.submit(http, file_id, trainer=trainer, n_epochs=2, batch_size=4)
        # The first checkpoint is spooled before the next step runs (``Reporter.checkpoint``),
        # and the step is in metrics.jsonl at once: fill the disk right then, so the next
        # checkpoint (jobs) or the next metrics line (artifacts) meets the full disk. The
        # trainer is stopped there (SIGSTOP to its process group) while the disk fills: on a
        # fast machine the tiny jax_lora job ran its last 15 steps, its final checkpoint and
        # its export in less time than the fill took, and succeeded before the disk was full.
        trainer = production.stop_trainer_when(stack.data_dir, job_id,
                                               lambda: len(_output_steps(stack, job_id)) > FIRST_CHECKPOINT,
                                               "the step after the first checkpoint")
        try:
            disk.fill()
        finally:
            os.killpg(trainer, signal.SIGCONT)
        wait_until(lambda: _listed_checkpoints(http, job_id), 60, "the first checkpoint to be listed")
        acknowledged = production.losses(http, job_id)

        done = production.finished(http, job_id, timeout=180)
        assert done["status"] == "failed", (done, _listed_checkpoints(http, job_id), stack.service.dump_logs())
        assert done["error"]["code"] == "disk_full", done["error"]
        assert "no space left on device" in done["error"]["message"].lower(), done["error"]
        assert done["restarts"] == 0, "a full disk is not a crash: restarting cannot help"
        messages = production.events(http, job_id)
        assert any(m.startswith("Job failed: disk_full") for m in messages), messages
        assert not any("(restart 1 of" in m for m in messages), messages  # never requeued as a lost run

        after = production.losses(http, job_id)
        assert set(acknowledged) <= set(after) and all(after[s] == acknowledged[s] for s in acknowledged)
        assert sorted(after) == list(range(1, len(after) + 1)), sorted(after)
        assert done["fine_tuned_model"] is None and done["result_files"] == []
        assert _listed_checkpoints(http, job_id) == [FIRST_CHECKPOINT]
    kept = stack.data_dir / "jobs" / job_id / "checkpoints" / f"step-{FIRST_CHECKPOINT}"
    assert (kept / "trainer_state.json").exists()
    # The metrics log holds whole lines only: the one the full disk cut short was taken back.
    log = (stack.data_dir / "artifacts" / job_id / "output" / "metrics.jsonl").read_text()
    assert log.endswith("\n") and production.output_metric_steps(stack.data_dir, job_id), log[-200:]
    assert stack.supervisors_alive() == {"api": None, "worker": None, "scheduler": None}
