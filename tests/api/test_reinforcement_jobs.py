"""Reinforcement jobs through the API: OpenAI's ``method.reinforcement`` object is checked in
full (hyperparameters, grader, response format, the files' format); a valid job is created for
either trainer (``auto``, ``fsdp_qlora`` or ``jax``, one GPU) and refused where no trainer can run
it (more than one GPU, a ``score_model`` grader).

Driven with the official ``openai`` SDK where a client would use it, and with raw bodies for the
errors (the SDK's types would refuse some of them before sending).
"""

from __future__ import annotations

import io
import json

import openai
import pytest

from api.jobs.schemas import JobCreate, _public_hyperparameters, public_method
from control.jobs.hyperparameters import resolve_settings
from tests.api.conftest import chat_lines
from tests.preference_data import sum_preference_lines
from trainers.spec import ReinforcementSpec

JOBS = "/v1/fine_tuning/jobs"
GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
          "reference": "{{item.reference_answer}}", "operation": "eq"}


def prompt_lines(n: int) -> bytes:
    return b"".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                "reference_answer": str(2 * i)}).encode() + b"\n" for i in range(n))


def rft(grader: dict | None = None, **hyperparameters) -> dict:
    method: dict = {"grader": GRADER if grader is None else grader}
    if hyperparameters:
        method["hyperparameters"] = hyperparameters
    return {"type": "reinforcement", "reinforcement": method}


def _upload(oai, data: bytes) -> str:
    file = oai.files.create(file=("data.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert oai.files.retrieve(file.id).status == "processed"
    return file.id


def test_a_valid_reinforcement_job_is_created_for_either_trainer(sdk, client) -> None:
    oai, tenant = sdk
    training = _upload(oai, prompt_lines(12))
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=training, validation_file=_upload(oai, prompt_lines(3)),
        method={"type": "reinforcement", "reinforcement": {
            "grader": GRADER,
            "hyperparameters": {"n_epochs": 2, "compute_multiplier": 2, "eval_interval": "auto",
                                "reasoning_effort": "low"}}},
    )
    assert job.status in ("validating_files", "queued")
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.to_dict() == GRADER
    assert [j.id for j in oai.fine_tuning.jobs.list().data] == [job.id]
    for trainer, shown in (("fsdp_qlora", "fsdp_qlora"), ("jax", "jax_lora"), ("jax_lora", "jax_lora")):
        explicit = client.post(JOBS, headers=tenant.headers, json={
            "model": "tunefleet-tiny-llama", "training_file": training, "trainer": trainer, "method": rft()})
        assert explicit.status_code == 200, explicit.text
        assert explicit.json()["trainer"] == shown  # the API's "jax" is the jax_lora trainer


@pytest.mark.parametrize(
    ("patch", "code", "param"),
    [
        ({"placement": {"gpus": 2}}, "invalid_request", "placement.gpus"),
        ({"trainer": "jax", "placement": {"gpus": 2}}, "invalid_request", "placement.gpus"),
        ({"method": rft({"type": "score_model", "name": "s", "model": "tunefleet-tiny-llama",
                         "input": [{"role": "user", "content": "{{sample.output_text}}"}]})},
         "invalid_request", "method.reinforcement.grader"),
    ],
)
def test_a_reinforcement_job_its_trainer_cannot_run_is_refused(client, tenant_key, processed_file, patch, code,
                                                               param) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers, prompt_lines(4)),
            "method": rft(), **patch}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert client.get(JOBS, headers=headers).json()["data"] == []


@pytest.mark.parametrize(
    ("grader", "code", "param"),
    [
        ({**GRADER, "operation": "gt"}, "invalid_grader", "method.reinforcement.grader.operation"),
        ({**GRADER, "input": "{{sample.output}}"}, "invalid_grader_template", "method.reinforcement.grader.input"),
        ({"type": "python", "name": "py", "source": "def grade(sample, item)\n"}, "invalid_python_grader",
         "method.reinforcement.grader.source"),
        ({"type": "score_model", "name": "s", "model": "not-served", "input": [{"role": "user", "content": "x"}]},
         "invalid_grader_model", "method.reinforcement.grader.model"),
        ({"type": "multi", "name": "m", "graders": {"a": {**GRADER, "reference": "{{itm.x}}"}},
          "calculate_output": "a"}, "invalid_grader_template", "method.reinforcement.grader.graders.a.reference"),
        ({"type": "tournament"}, "invalid_grader", "method.reinforcement.grader.type"),
    ],
)
def test_an_invalid_grader_is_refused_with_its_code_and_field(client, tenant_key, processed_file, grader, code,
                                                              param) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers, prompt_lines(4)),
            "method": rft(grader)}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"method": {"type": "reinforcement"}}, "method"),
        ({"method": {"type": "reinforcement", "reinforcement": {}}}, "method.reinforcement.grader"),
        ({"method": {"type": "reinforcement", "reinforcement": {"grader": "exact"}}}, "method.reinforcement.grader"),
        ({"method": rft(compute_multiplier=0)}, "method.reinforcement.hyperparameters.compute_multiplier"),
        ({"method": rft(compute_multiplier=17)}, "method.reinforcement.hyperparameters.compute_multiplier"),
        ({"method": rft(eval_interval=0)}, "method.reinforcement.hyperparameters.eval_interval"),
        ({"method": rft(eval_samples="many")}, "method.reinforcement.hyperparameters.eval_samples"),
        ({"method": rft(reasoning_effort="extreme")}, "method.reinforcement.hyperparameters.reasoning_effort"),
        ({"method": rft(clip_epsilon=1.5)}, "method.reinforcement.hyperparameters.clip_epsilon"),
        ({"method": rft(beta=0.1)}, "method.reinforcement.hyperparameters.beta"),
        ({"method": {"type": "reinforcement", "reinforcement": {"grader": GRADER, "response_format": {
            "type": "json_schema"}}}}, "method.reinforcement.response_format"),
        ({"method": {"type": "reinforcement", "reinforcement": {"grader": GRADER, "seed": 1}}},
         "method.reinforcement.seed"),
        ({"method": {"type": "reinforcement", "dpo": {}, "reinforcement": {"grader": GRADER}}}, "method"),
        ({"method": rft(), "hyperparameters": {"n_epochs": 2}}, "method"),
        ({"method": rft(), "packing": True}, "packing"),
    ],
)
def test_bad_reinforcement_bodies_name_the_field(client, tenant_key, processed_file, patch, param) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers, prompt_lines(4)), **patch}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error


@pytest.mark.parametrize(
    ("training", "validation", "method", "param"),
    [
        ("chat", None, "reinforcement", "training_file"),
        ("preference", None, "reinforcement", "training_file"),
        ("prompts", "chat", "reinforcement", "validation_file"),
        ("prompts", None, None, "training_file"),
        ("prompts", None, "supervised", "training_file"),
        ("prompts", None, "dpo", "training_file"),
    ],
)
def test_a_file_whose_format_does_not_suit_the_method_is_refused(sdk, training, validation, method, param) -> None:
    oai, _ = sdk
    data = {"chat": chat_lines(12), "preference": sum_preference_lines(12), "prompts": prompt_lines(12)}
    body = {"model": "tunefleet-tiny-llama", "training_file": _upload(oai, data[training])}
    if validation is not None:
        body["validation_file"] = _upload(oai, data[validation])
    if method == "reinforcement":
        body["method"] = rft()
    elif method is not None:
        body["method"] = {"type": method}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.fine_tuning.jobs.create(**body)
    assert (caught.value.code, caught.value.param) == ("file_method_mismatch", param)
    assert "reinforcement" in caught.value.message
    assert oai.fine_tuning.jobs.list().data == []


def test_auto_values_resolve_into_the_job_object_and_the_trainer_spec() -> None:
    body = JobCreate.model_validate({
        "model": "m", "training_file": "file-x",
        "method": {"type": "reinforcement", "reinforcement": {
            "grader": GRADER, "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": {"type": "object"}, "strict": True}},
            "hyperparameters": {"batch_size": 4, "compute_multiplier": 2.5, "kl_coef": 0.04}}}})
    settings = body.job_settings(max_seq_len=512)
    assert not settings.resolved and settings.method.type == "reinforcement"
    row = settings.row_columns()
    assert row["method"] == {"type": "reinforcement", "grader": GRADER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}}
    shown = public_method(row["method"], _public_hyperparameters(row["hyperparameters"]))
    assert shown["reinforcement"]["hyperparameters"]["eval_interval"] == "auto"

    resolved = resolve_settings(settings, n_examples=40)  # 10 steps an epoch, 3 epochs
    assert resolved.resolved
    row = resolved.row_columns()
    hp = row["hyperparameters"]
    assert (hp["n_epochs"], hp["batch_size"], hp["total_steps"]) == (3, 4, 30)
    assert (hp["compute_multiplier"], hp["eval_interval"], hp["eval_samples"], hp["reasoning_effort"]) == (
        2.5, 3, 1, "default")
    assert (hp["kl_coef"], hp["clip_epsilon"], hp["max_completion_tokens"]) == (0.04, 0.2, 1024)
    shown = public_method(row["method"], _public_hyperparameters(hp))
    assert shown["type"] == "reinforcement" and shown["reinforcement"]["grader"] == GRADER
    assert shown["reinforcement"]["hyperparameters"]["compute_multiplier"] == 2.5
    assert shown["reinforcement"]["response_format"]["json_schema"]["name"] == "answer"

    spec = resolved.method.spec()
    assert spec.type == "reinforcement" and spec.reinforcement == ReinforcementSpec(
        grader=GRADER, samples_per_prompt=10, max_completion_tokens=1024, eval_interval=3, eval_samples=1,
        kl_coef=0.04, clip_epsilon=0.2, response_format=row["method"]["response_format"])


@pytest.mark.parametrize(
    ("grader", "param"),
    [
        ({**GRADER, "reference": "{{item.answer}}"}, "method.reinforcement.grader.reference"),
        ({"type": "multi", "name": "m", "calculate_output": "a",
          "graders": {"a": {**GRADER, "input": "{{item.hint}} {{sample.output_text}}"}}},
         "method.reinforcement.grader.graders.a.input"),
        ({"type": "score_model", "name": "s", "model": "tunefleet-tiny-llama", "input": [
            {"role": "user", "content": "Reference: {{item.reference_answer}}. Graded: {{item.solution[0]}}"}]},
         "method.reinforcement.grader.input[0].content"),
    ],
)
def test_a_grader_reading_a_key_the_lines_lack_is_refused(client, tenant_key, processed_file, grader, param) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers, prompt_lines(4)),
            "method": rft(grader)}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("grader_item_missing", param), error
    assert "messages, reference_answer" in error["message"]


def test_an_estimate_plans_one_gpu_and_the_sampled_group(client, tenant_key) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "n_examples": 1000}

    def estimate(**extra):
        response = client.post("/v1/fine_tuning/estimate", headers=headers, json={**body, **extra})
        assert response.status_code == 200, response.text
        return {row["pool"]: row for row in response.json()["pools"]}

    sft = estimate()
    rl = estimate(method=rft(compute_multiplier=1))  # 4 completions per prompt
    assert all(row["gpus"] in (1, None) for row in rl.values()), rl
    common = [p for p in rl if rl[p]["memory_per_gpu_bytes"] and sft[p]["memory_per_gpu_bytes"]]
    assert common and all(rl[p]["memory_per_gpu_bytes"] > sft[p]["memory_per_gpu_bytes"] for p in common)
