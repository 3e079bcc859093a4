"""``/v1/fine_tuning/alpha/graders/*`` through the official ``openai`` SDK against a live
server: OpenAI's shapes, the stable error codes, ``score_model`` on a model this service
serves (the real inference worker and client; its engine scripted to answer a score), and
a python grader that never ends while the API keeps answering.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import SecretStr

from inference.protocol import StreamEvent
from inference.server import create_app as worker_app
from tests.inference.scripted import ScriptedEngine

SECRET = "s" * 32
CHECK = {"type": "string_check", "name": "Example string check grader", "input": "{{sample.output_text}}",
         "reference": "{{item.label}}", "operation": "eq"}


class ScoreEngine(ScriptedEngine):
    """A model that answers ``answer`` to every chat, and keeps what it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = '{"steps": [], "result": 0.75}'

    def generate(self, request):
        yield StreamEvent(type="start", prompt_tokens=9, queued_s=0.0)
        yield StreamEvent(type="text", index=0, text=self.answer)
        yield StreamEvent(type="finish", index=0, finish_reason="stop", completion_tokens=4)


@pytest.fixture
def backend() -> str:
    """Grading reads the database only to resolve a model by the shared queries: SQLite is enough."""
    return "sqlite"


@pytest.fixture
def engine() -> ScoreEngine:
    return ScoreEngine()


@pytest.fixture
def api(settings, inline_queue, engine, live_server):
    """``api(**settings)`` -> the live API's base URL, in front of a worker with ``engine``."""
    from api.main import create_app

    worker_url = live_server(worker_app(engine, SECRET))

    def start(**overrides: Any) -> str:
        values = {"inference_url": worker_url, "inference_secret": SecretStr(SECRET), **overrides}
        return live_server(create_app(settings.model_copy(update=values), queue=inline_queue))

    return start


def test_the_sdk_validates_and_runs_graders(api, tenant_key) -> None:
    oai = OpenAI(api_key=tenant_key().key, base_url=f"{api()}/v1", max_retries=0)
    graders = oai.fine_tuning.alpha.graders
    assert graders.validate(grader=CHECK).grader.model_dump(exclude_none=True) == CHECK

    run = graders.run(grader=CHECK, model_sample="Paris", item={"label": "Paris"})
    assert run.reward == 1.0 and run.sub_rewards == {} and run.metadata.type == "string_check"
    assert run.metadata.name == CHECK["name"] and not run.metadata.errors.invalid_variable_error

    multi = {"type": "multi", "name": "contact", "calculate_output": "0.5 * name + 0.5 * email ^ 2", "graders": {
        "name": {"type": "text_similarity", "name": "n", "input": "{{sample.output_json.name}}",
                 "reference": "{{item.name}}", "evaluation_metric": "fuzzy_match"},
        "email": {**CHECK, "input": "{{sample.output_json.email}}", "reference": "{{item.email}}"},
        "script": {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 0.25\n"}}}
    run = graders.run(grader=multi, model_sample='{"name": "Ann", "email": "a@x.io"}',
                      item={"name": "Ann", "email": "a@x.io"})
    assert (run.reward, run.sub_rewards) == (1.0, {"name": 1.0, "email": 1.0, "script": 0.25})

    missing = graders.run(grader=CHECK, model_sample="Paris", item={})
    assert (missing.reward, missing.metadata.errors.invalid_variable_error) == (0.0, True)
    broken = graders.run(grader={"type": "python", "name": "py", "source": "def grade(s, i):\n    return 1 / 0\n"},
                         model_sample="x")
    assert broken.metadata.errors.python_grader_runtime_error
    assert broken.metadata.errors.python_grader_runtime_error_details == "ZeroDivisionError: division by zero"

    for grader, code, param in [
        ({**CHECK, "operation": "gt"}, "invalid_grader", "grader.operation"),
        ({**CHECK, "input": "{{sample.output}}"}, "invalid_grader_template", "grader.input"),
        ({"type": "python", "name": "py", "source": "def grade(sample, item)\n"}, "invalid_python_grader",
         "grader.source"),
        ({**multi, "calculate_output": "name + __import__('os')"}, "invalid_grader_formula",
         "grader.calculate_output"),
        ({"type": "score_model", "name": "s", "model": "not-served", "input": [{"role": "user", "content": "x"}]},
         "invalid_grader_model", "grader.model"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            graders.validate(grader=grader)
        assert (refused.value.code, refused.value.param) == (code, param)
        assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(api_key="tf_nope", base_url=oai.base_url, max_retries=0).fine_tuning.alpha.graders.validate(
            grader=CHECK)


def test_score_model_grades_with_a_model_this_service_serves(api, tenant_key, engine, settings) -> None:
    tenant = tenant_key()
    oai = OpenAI(api_key=tenant.key, base_url=f"{api()}/v1", max_retries=0)
    grader = {"type": "score_model", "name": "judge", "model": "tunefleet-tiny-llama", "range": [0, 1],
              "sampling_params": {"temperature": 0, "seed": 42, "max_completions_tokens": 16},
              "input": [{"role": "user", "content": [{"type": "input_text", "text": (
                  "Reference answer: {{item.reference_answer}}\nModel answer: {{sample.output_text}}")}]}]}
    run = oai.fine_tuning.alpha.graders.run(grader=grader, model_sample="fuzzy wuzzy was a bear",
                                            item={"reference_answer": "fuzzy wuzzy had no hair"})
    assert run.reward == 0.75 and run.metadata.sampled_model_name == "tunefleet-tiny-llama"
    assert run.metadata.token_usage == 13
    assert run.model_grader_token_usage_per_model == {
        "tunefleet-tiny-llama": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    asked = engine.requests[-1]
    assert asked.messages == ({"role": "user", "content": "Reference answer: fuzzy wuzzy had no hair\n"
                                                          "Model answer: fuzzy wuzzy was a bear"},)
    assert asked.base.path == str(settings.models_dir / "tiny-llama")
    assert (asked.sampling.temperature, asked.sampling.seed, asked.sampling.max_tokens) == (0.0, 42, 16)
    assert (asked.tenant, asked.sampling.fit_context) == (tenant.tenant_id, False)  # turns as that tenant

    engine.answer = "I would say it is good"
    unparsed = oai.fine_tuning.alpha.graders.run(grader=grader, model_sample="x", item={"reference_answer": "y"})
    assert (unparsed.reward, unparsed.metadata.errors.model_grader_parse_error) == (0.0, True)


def test_a_python_grader_that_never_ends_is_stopped_and_the_api_keeps_answering(api, tenant_key) -> None:
    base = api(grader_seconds_per_sample=3.0)
    tenant, other = tenant_key(), tenant_key()
    endless = {"type": "python", "name": "loop", "source": "def grade(sample, item):\n    while True:\n        pass\n"}
    answers: dict[str, Any] = {}

    def run_endless() -> None:
        answers["run"] = httpx.post(f"{base}/v1/fine_tuning/alpha/graders/run", timeout=30,
                                    headers={"Authorization": f"Bearer {tenant.key}"},
                                    json={"grader": endless, "model_sample": "x"})

    worker = threading.Thread(target=run_endless)
    worker.start()
    time.sleep(0.5)  # the grader is running (it holds the tenant's python slot for 3 s)
    started = time.monotonic()
    health = httpx.get(f"{base}/healthz", timeout=5)
    quick = httpx.post(f"{base}/v1/fine_tuning/alpha/graders/run", timeout=5,
                       headers={"Authorization": f"Bearer {other.key}"},
                       json={"grader": CHECK, "model_sample": "a", "item": {"label": "a"}})
    busy = httpx.post(f"{base}/v1/fine_tuning/alpha/graders/run", timeout=5,
                      headers={"Authorization": f"Bearer {tenant.key}"}, json={"grader": endless, "model_sample": "x"})
    answered_in = time.monotonic() - started
    worker.join(30)
    assert health.status_code == 200 and quick.json()["reward"] == 1.0
    assert answered_in < 2.5, answered_in  # while the endless grader ran
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "graders_busy"
    errors = answers["run"].json()["metadata"]["errors"]
    assert answers["run"].status_code == 200
    assert (errors["python_grader_server_error"], errors["python_grader_server_error_type"]) == (True, "timeout")
