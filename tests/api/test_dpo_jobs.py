"""DPO jobs through the API: OpenAI's ``method`` object, preference files, resolved values.

Driven with the official ``openai`` SDK where a client would use it, and with raw bodies
for the errors (the SDK's types would refuse some of them before sending).
"""

from __future__ import annotations

import io

import openai
import pytest

from tests.api.conftest import chat_lines
from tests.preference_data import sum_preference_lines

JOBS = "/v1/fine_tuning/jobs"


def _upload(oai, data: bytes) -> str:
    file = oai.files.create(file=("data.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert oai.files.retrieve(file.id).status == "processed"
    return file.id


def test_sdk_creates_a_dpo_job_and_reads_back_its_method(sdk) -> None:
    oai, _ = sdk
    training = _upload(oai, sum_preference_lines(12))
    validation = _upload(oai, sum_preference_lines(4, start=12))
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=training, validation_file=validation,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}},
    )
    assert job.status == "queued" and job.method.type == "dpo" and job.method.supervised is None
    hp = job.method.dpo.hyperparameters
    # 12 preference pairs: the supervised rule, counted in pairs (batch 1, ceil(100 / 12) epochs).
    assert (hp.beta, hp.batch_size, hp.n_epochs, hp.learning_rate_multiplier) == (0.2, 1, 9, 1.0)
    again = oai.fine_tuning.jobs.retrieve(job.id)
    assert again.method.to_dict() == job.method.to_dict()
    assert [j.method.type for j in oai.fine_tuning.jobs.list()] == ["dpo"]


def test_auto_beta_and_extensions_resolve(sdk) -> None:
    oai, _ = sdk
    training = _upload(oai, sum_preference_lines(12))
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=training,
        method={"type": "dpo", "dpo": {"hyperparameters": {
            "beta": "auto", "batch_size": 4, "n_epochs": 2, "learning_rate_multiplier": 0.5}}},
        extra_body={"max_seq_len": 128},
    )
    hp = job.method.dpo.hyperparameters
    assert (hp.beta, hp.batch_size, hp.n_epochs) == (0.1, 4, 2)
    extras = hp.to_dict()
    assert extras["learning_rate"] == pytest.approx(1e-4) and extras["sft_weight"] == 0.0
    assert job.to_dict()["total_steps"] == 6  # ceil(12 / 4) x 2


def test_supervised_method_still_honoured(sdk) -> None:
    oai, _ = sdk
    training = _upload(oai, chat_lines(12))
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=training,
        method={"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 2}}},
    )
    assert job.method.type == "supervised" and job.method.dpo is None
    assert job.method.supervised.hyperparameters.batch_size == 2
    assert "beta" not in job.method.supervised.hyperparameters.to_dict()


@pytest.mark.parametrize(
    ("training", "validation", "method", "param"),
    [
        ("preference", None, None, "training_file"),
        ("preference", None, "supervised", "training_file"),
        ("chat", None, "dpo", "training_file"),
        ("preference", "chat", "dpo", "validation_file"),
        ("chat", "preference", "supervised", "validation_file"),
    ],
)
def test_a_file_whose_format_does_not_suit_the_method_is_refused(sdk, training, validation, method, param) -> None:
    oai, _ = sdk
    data = {"chat": chat_lines(12), "preference": sum_preference_lines(12)}
    body = {"model": "tunefleet-tiny-llama", "training_file": _upload(oai, data[training])}
    if validation is not None:
        body["validation_file"] = _upload(oai, data[validation])
    if method is not None:
        body["method"] = {"type": method}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.fine_tuning.jobs.create(**body)
    assert (caught.value.code, caught.value.param) == ("file_method_mismatch", param)
    assert caught.value.status_code == 400
    assert ("preference" in caught.value.message) and ("dpo" in caught.value.message)
    assert oai.fine_tuning.jobs.list().data == []


def test_a_mismatch_found_after_validation_fails_the_job(client, tenant_key, upload, inline_queue) -> None:
    headers = tenant_key().headers
    inline_queue.run_validation = False
    file_id = upload(headers, chat_lines(12)).json()["id"]
    job = client.post(JOBS, headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": file_id, "method": {"type": "dpo"}}).json()
    assert job["status"] == "validating_files"
    assert job["method"] == {"type": "dpo", "dpo": {"hyperparameters": {
        "n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto", "beta": "auto"}}}
    assert inline_queue.validate(file_id) == []
    failed = client.get(f"{JOBS}/{job['id']}", headers=headers).json()
    assert failed["status"] == "failed"
    assert (failed["error"]["code"], failed["error"]["param"]) == ("file_method_mismatch", "training_file")


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 2.5}}}},
         "method.dpo.hyperparameters.beta"),
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}},
         "method.dpo.hyperparameters.beta"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.5}}}},
         "method.supervised.hyperparameters.beta"),
        ({"method": {"type": "dpo", "supervised": {}}}, "method"),
        ({"method": {"type": "reinforcement"}}, "method"),  # no method.reinforcement (grader)
        ({"method": {"type": "distillation"}}, "method.type"),
        ({"method": {"type": "dpo"}, "hyperparameters": {"n_epochs": 2}}, "method"),
        ({"hyperparameters": {"n_epochs": 2},
          "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}}}, "method"),
        ({"method": {"type": "dpo"}, "packing": True}, "packing"),
    ],
)
def test_bad_dpo_bodies_name_the_field(client, tenant_key, processed_file, patch, param) -> None:
    headers = tenant_key().headers
    data = chat_lines(12) if patch["method"]["type"] == "supervised" else sum_preference_lines(12)
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers, data), **patch}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error
    assert error["message"]
