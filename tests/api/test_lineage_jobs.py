"""Jobs that continue a fine-tuned model (``api.jobs.lineage``): ``model`` names the
caller's fine-tuned model, one of its checkpoints, or one shared with it; the job trains on
the parent's base stored as the parent stored it, its trainer spec gets the parent's
stored adapter, and refusals carry their codes."""

from __future__ import annotations

from control.db.models import Job
from control.job_settings import JobSettings
from control.jobs.lifecycle import transition
from control.jobs.naming import fine_tuned_model_id
from tests.api.test_chat_completions import job_with_adapters
from tests.preference_data import sum_preference_lines
from worker.spec_builder import build_spec

JOBS = "/v1/fine_tuning/jobs"
BASE = "tunefleet-tiny-llama"
# The parent trains QLoRA on an HQQ base: a storage the JAX trainer cannot train.
PARENT_ADAPTER = {"method": "qlora", "quantization": "hqq4", "r": 4, "target_modules": ["q_proj", "v_proj"]}


def _error(answer) -> tuple[int, str, str | None]:
    body = answer.json()["error"]
    return answer.status_code, body["code"], body["param"]


def _parent(client, db_session, settings, make_job, headers, *, succeed: bool = True):
    """A job with a final adapter and a checkpoint at step 2: (row, its model, its checkpoint)."""
    row, _, _ = job_with_adapters(client, db_session, settings, make_job(headers, adapter=PARENT_ADAPTER)["id"])
    if succeed:
        transition(db_session, row, "succeeded", actor="executor")
        db_session.commit()
    return row, fine_tuned_model_id(row), f"{fine_tuned_model_id(row)}:ckpt-step-2"


def test_a_job_continues_a_fine_tuned_model_or_checkpoint_on_the_parents_base(
        client, db_session, settings, tenant_key, make_job, processed_file) -> None:
    owner = tenant_key()
    parent, model, checkpoint = _parent(client, db_session, settings, make_job, owner.headers)

    child = make_job(owner.headers, model=model, adapter={"r": 2, "alpha": 4, "target_modules": ["o_proj"]})
    assert (child["model"], child["base_model"]) == (model, BASE)
    assert {k: child["adapter"][k] for k in ("method", "quantization", "r", "target_modules")} == {
        "method": "qlora", "quantization": "hqq4", "r": 2, "target_modules": ["o_proj"]}
    row = db_session.get_one(Job, child["id"])
    assert fine_tuned_model_id(row) == f"ft:{BASE}:{owner.tenant_id}:{row.id}"  # named after the root base
    lineage = JobSettings.from_row(row).parent
    assert (lineage.model, lineage.job_id, lineage.step, lineage.r, lineage.target_modules) == (
        model, parent.id, None, 4, ("q_proj", "v_proj"))
    assert "error" not in child["estimate"], child["estimate"]

    pairs = processed_file(owner.headers, sum_preference_lines(8))
    dpo = make_job(owner.headers, model=checkpoint, training_file=pairs, max_seq_len=64,
                   method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}})
    assert (dpo["model"], dpo["base_model"], dpo["method"]["type"]) == (checkpoint, BASE, "dpo")

    for job_id, adapter in ((child["id"], "output/adapter"), (dpo["id"], "checkpoints/step-2/adapter")):
        job = db_session.get_one(Job, job_id)
        spec = build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",), gpus=1,
                          token="t")
        (parent_adapter,) = spec.model.parent_adapters
        assert parent_adapter.path.endswith(f"{parent.id}/{adapter}") and parent_adapter.name == job.model
        assert (spec.adapter.quantization, spec.model.name) == ("hqq4", BASE)

    # The model an unfinished job continues stays until that job ends.
    assert _error(client.delete(f"/v1/models/{model}", headers=owner.headers)) == (409, "model_in_use", "model")


def test_a_shared_checkpoint_can_be_continued_by_the_tenant_it_is_shared_with(
        client, db_session, settings, tenant_key, make_job) -> None:
    owner, friend = tenant_key(), tenant_key()
    _, model, checkpoint = _parent(client, db_session, settings, make_job, owner.headers)
    refused = client.post(JOBS, headers=friend.headers, json={"model": checkpoint, "training_file": "file-x"})
    assert _error(refused) == (400, "invalid_model", "model")  # not confirmed to exist
    granted = client.post(f"/v1/fine_tuning/checkpoints/{checkpoint}/permissions", headers=owner.headers,
                          json={"project_ids": [friend.tenant_id]})
    assert granted.status_code == 200, granted.text
    child = make_job(friend.headers, model=checkpoint)
    assert (child["model"], child["base_model"], child["organization_id"]) == (checkpoint, BASE, friend.tenant_id)
    refused = client.post(JOBS, headers=friend.headers, json={"model": model, "training_file": "file-x"})
    assert _error(refused) == (400, "invalid_model", "model")  # the checkpoint is shared, not the model


def test_parents_that_cannot_be_continued_are_refused_with_codes(
        client, db_session, settings, tenant_key, make_job, processed_file) -> None:
    owner, stranger = tenant_key(), tenant_key()
    running, model, checkpoint = _parent(client, db_session, settings, make_job, owner.headers, succeed=False)
    file_id = processed_file(owner.headers)

    def create(headers, **body):
        return _error(client.post(JOBS, headers=headers, json={"training_file": file_id, **body}))

    assert create(owner.headers, model=model) == (400, "parent_not_succeeded", "model")
    assert create(owner.headers, model=checkpoint) == (400, "parent_not_succeeded", "model")
    transition(db_session, running, "succeeded", actor="executor")
    db_session.commit()
    assert create(stranger.headers, model=model, training_file=processed_file(stranger.headers)) == (
        400, "invalid_model", "model")
    assert create(owner.headers, model=f"{model}:ckpt-step-9") == (400, "invalid_model", "model")
    assert create(owner.headers, model=f"ft:{BASE}:{owner.tenant_id}:ftjob-nope") == (400, "invalid_model", "model")
    assert create(owner.headers, model=model, adapter={"method": "lora"}) == (
        400, "parent_base_mismatch", "adapter.method")
    assert create(owner.headers, model=model, trainer="jax") == (400, "parent_base_unsupported", "trainer")
    estimate = client.post("/v1/fine_tuning/estimate", headers=owner.headers, json={"model": model, "n_examples": 8})
    assert estimate.status_code == 200, estimate.text
