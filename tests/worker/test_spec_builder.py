"""worker/spec_builder.py: the parallel layout a job's spec gets, per pool and trainer.

Jobs are created through the real API (SQLite migrated by Alembic, file validation run
inline), then turned into specs the way the scheduler's admission does.
"""

from __future__ import annotations

import json

import pytest

from control.db.models import Job
from worker.spec_builder import build_spec, cpu_host_devices, local_trainer_cores

JOBS = "/v1/fine_tuning/jobs"


def _chat_lines(n: int = 12) -> bytes:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _job_row(client, tenant_key, db_session, *, trainer: str, batch_size: int) -> Job:
    headers = tenant_key().headers
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("train.jsonl", _chat_lines(), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    created = client.post(JOBS, headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": upload.json()["id"], "trainer": trainer,
        "hyperparameters": {"batch_size": batch_size, "n_epochs": 1}})
    assert created.status_code == 200, created.text
    return db_session.get(Job, created.json()["id"])


@pytest.mark.parametrize(
    ("threads", "slots", "available", "cores"),
    [("2", 1, 2, 2), ("1", 1, 2, 1), ("2", 2, 8, 4), ("4", 1, 2, 2), ("", 1, 16, 2)],
)
def test_local_trainer_cores_are_its_threads_per_slot_capped_by_the_host(threads, slots, available, cores):
    assert local_trainer_cores(slots, {"OMP_NUM_THREADS": threads}, available=available) == cores


@pytest.mark.parametrize(
    ("cores", "batch_size", "devices"),
    [(2, 4, 2), (2, 1, 1), (2, 3, 1), (4, 6, 3), (4, 8, 4), (1, 8, 1)],
)
def test_cpu_host_devices_are_one_per_core_dividing_the_batch(cores, batch_size, devices):
    assert cpu_host_devices(cores, batch_size) == devices


def _local_jax_spec(client, tenant_key, db_session, settings, monkeypatch, batch_size):
    """The spec of a jax job with ``batch_size`` on a 2-core local pool (2 threads per trainer)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    job = _job_row(client, tenant_key, db_session, trainer="jax", batch_size=batch_size)
    return build_spec(db_session, job, settings, pool_accelerator="cpu",
                      pool_families=("fsdp_qlora", "jax_lora"), gpus=1, token="t")


def test_local_pool_jax_job_gets_one_host_device_per_core(client, tenant_key, db_session, settings, monkeypatch):
    spec = _local_jax_spec(client, tenant_key, db_session, settings, monkeypatch, batch_size=4)
    assert spec.trainer == "jax_lora"
    assert spec.model.name == "tunefleet-tiny-llama"  # the registry id: what exported adapters cite
    par = spec.parallelism
    assert (par.mesh.data, par.mesh.fsdp, par.mesh.tensor, par.host_devices) == (2, 1, 1, 2)
    # The global batch splits over the 2 data-parallel devices without a remainder.
    hp = spec.hyperparameters
    assert hp.batch_size % (hp.micro_batch_size * par.mesh.data) == 0


def test_odd_batch_keeps_one_host_device(client, tenant_key, db_session, settings, monkeypatch):
    spec = _local_jax_spec(client, tenant_key, db_session, settings, monkeypatch, batch_size=3)
    assert (spec.parallelism.mesh.data, spec.parallelism.host_devices) == (1, 1)


@pytest.mark.parametrize(
    ("accelerator", "families", "trainer", "in_cluster"),
    [
        ("amd-mi300x", ("jax_lora",), "jax", False),  # GPU pool: the mesh follows the GPUs
        ("cpu", ("jax_lora",), "jax", True),  # a CPU pool in Kubernetes: pod cores unknown here
        ("cpu", ("fsdp_qlora", "jax_lora"), "fsdp_qlora", False),  # torch trainer: processes
    ],
)
def test_other_pools_and_trainers_get_no_host_devices(client, tenant_key, db_session, settings,
                                                      accelerator, families, trainer, in_cluster):
    job = _job_row(client, tenant_key, db_session, trainer=trainer, batch_size=8)
    spec = build_spec(db_session, job, settings, pool_accelerator=accelerator, pool_families=families,
                      gpus=2, token="t", in_cluster=in_cluster)
    assert spec.parallelism.host_devices is None
    if spec.trainer == "jax_lora":
        assert (spec.parallelism.mesh.data, spec.parallelism.mesh.fsdp) == (1, 2)


@pytest.mark.parametrize("in_cluster", [False, True])
def test_a_new_run_reports_past_the_seqs_the_api_applied(client, tenant_key, db_session, settings, in_cluster):
    from control.db.models import ReportBatch

    job = _job_row(client, tenant_key, db_session, trainer="fsdp_qlora", batch_size=8)
    first = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",),
                       gpus=1, token="t", in_cluster=in_cluster)
    assert first.report.first_seq == 1
    db_session.add_all([ReportBatch(job_id=job.id, seq=seq, n_items=1) for seq in (1, 2, 5)])
    db_session.flush()
    again = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",),
                       gpus=1, token="t", in_cluster=in_cluster)
    assert again.report.first_seq == 6
    # Each job's spool is its own, also where pods share a node's /tmp.
    assert job.id in again.report.spool_dir


def test_a_dpo_job_maps_to_the_dpo_method_on_preference_data(client, tenant_key, db_session, settings):
    from tests.preference_data import sum_preference_lines

    headers = tenant_key().headers
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("prefs.jsonl", sum_preference_lines(12), "application/jsonl")})
    created = client.post(JOBS, headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": upload.json()["id"], "trainer": "fsdp_qlora",
        "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "batch_size": 4,
                                                              "sft_weight": 0.5}}}})
    assert created.status_code == 200, created.text
    job = db_session.get(Job, created.json()["id"])
    spec = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",),
                      gpus=1, token="t")
    assert (spec.method.type, spec.method.beta, spec.method.sft_weight) == ("dpo", 0.25, 0.5)
    assert spec.data.format == "preference" and spec.hyperparameters.batch_size == 4


def test_a_supervised_job_maps_to_the_supervised_method(client, tenant_key, db_session, settings):
    job = _job_row(client, tenant_key, db_session, trainer="fsdp_qlora", batch_size=4)
    spec = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",),
                      gpus=1, token="t")
    assert spec.method.type == "supervised" and spec.data.format == "chat"


def test_a_reinforcement_row_maps_to_the_reinforcement_method_and_the_trainer_refuses_it(
        client, tenant_key, db_session, settings):
    # A reinforcement row (its settings' columns, resolved) builds its spec; the supervised
    # and DPO data entry refuses it with a clear code instead of training the prompts as
    # supervised data; both trainers read them as prompts (load_reinforcement_data).
    from api.jobs.schemas import JobCreate
    from control.jobs.hyperparameters import resolve_settings
    from trainers.common.preference import load_training_data
    from trainers.errors import UserError

    headers = tenant_key().headers
    prompts = "".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"}], "answer": str(2 * i)})
                      + "\n" for i in range(8)).encode()
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("prompts.jsonl", prompts, "application/jsonl")})
    assert upload.status_code == 200, upload.text
    job = _job_row(client, tenant_key, db_session, trainer="fsdp_qlora", batch_size=4)
    grader = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}
    body = JobCreate.model_validate({"model": job.model, "training_file": upload.json()["id"], "method": {
        "type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {
            "batch_size": 4, "compute_multiplier": 0.5, "kl_coef": 0.04}}}})
    columns = resolve_settings(body.job_settings(max_seq_len=job.max_seq_len, seed=job.seed), 8).row_columns()
    for name, value in columns.items():
        setattr(job, name, value)
    job.training_file = upload.json()["id"]
    db_session.commit()
    assert client.get(f"/v1/files/{job.training_file}", headers=headers).json()["status"] == "processed"

    spec = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",),
                      gpus=1, token="t")
    assert spec.method.type == "reinforcement" and spec.data.format == "reinforcement"
    rl = spec.method.reinforcement
    assert (rl.grader, rl.samples_per_prompt, rl.kl_coef, rl.clip_epsilon) == (grader, 2, 0.04, 0.2)
    with pytest.raises(UserError) as refused:
        load_training_data(spec, tokenizer=None)
    assert refused.value.code == "method_unsupported" and "reinforcement" in refused.value.message
