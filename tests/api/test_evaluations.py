"""Held-out evaluations: the base and the fine-tuned model answer a file's rows through the
completion path (the real worker server and client, a scripted engine), graded by the
service's graders, in the background; their checks, tenant isolation, and what happens to
one under way when its API process stops.

The engine answers "What is N plus N?" with 2N when the request carries the job's adapter
(except N = 0: "zero") and with a sentence around it on the base model, so exact match is
0 % before and (rows - 1) / rows after, whatever the rows.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.evaluations.results import format_score, model_score, summary
from api.evaluations.rows import evaluation_rows
from api.evaluations.runner import EvaluationRunner
from api.evaluations.schemas import DEFAULT_GRADER
from control.db.base import utcnow
from control.db.models import Evaluation, JobEvent
from control.jobs.lifecycle import transition
from inference.protocol import StreamEvent
from inference.server import create_app as worker_app
from tests.api.conftest import chat_lines
from tests.api.test_chat_completions import job_with_adapters
from tests.inference.scripted import ScriptedEngine
from trainers.common.graders import GradeResult

SECRET = "e" * 32
ROWS = 5


class ArithmeticEngine(ScriptedEngine):
    """See the module doc; ``gated`` holds every request after its start until released."""

    def __init__(self) -> None:
        super().__init__()
        self.gated = False

    def release(self) -> None:
        self.gated = False
        self.changed()

    def generate(self, request):
        n = int(request.messages[-1]["content"].split()[2])
        yield StreamEvent(type="start", prompt_tokens=7, queued_s=0.0)
        if not self.wait_until(lambda: not self.gated):
            return
        text = ("zero" if n == 0 else str(2 * n)) if request.adapter is not None else f"It is {2 * n}."
        yield StreamEvent(type="text", index=0, text=text)
        yield StreamEvent(type="finish", index=0, finish_reason="stop", completion_tokens=2)


@pytest.fixture
def engine() -> ArithmeticEngine:
    return ArithmeticEngine()


@pytest.fixture
def api(settings, inline_queue, engine, live_server) -> Callable[..., Any]:
    """``api(**settings)``: a context manager of a TestClient on a new app (its lifespan
    runs: startup takes over evaluations, exit gives them back) in front of the worker."""
    worker_url = live_server(worker_app(engine, SECRET))

    @contextmanager
    def start(**overrides: Any) -> Iterator[TestClient]:
        from api.main import create_app

        values = {"inference_url": worker_url, "inference_secret": SecretStr(SECRET), **overrides}
        app = create_app(settings.model_copy(update=values), queue=inline_queue)
        app.state.evaluations = EvaluationRunner(app, sweep_s=0.2)
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client

    return start


@pytest.fixture
def succeeded_job(client, db_session, settings, make_job) -> Callable[[dict[str, str]], Any]:
    def make(headers: dict[str, str]) -> Any:
        row, _, _ = job_with_adapters(client, db_session, settings, make_job(headers)["id"])
        transition(db_session, row, "succeeded", actor="executor")
        db_session.commit()
        return row

    return make


def wait_evaluation(client: TestClient, headers: dict[str, str], job_id: str, evaluation_id: str,
                    statuses: tuple[str, ...] = ("succeeded", "failed"), timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}", headers=headers).json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_base_and_fine_tuned_answers_graded_in_the_background(api, engine, tenant_key, succeeded_job,
                                                              processed_file, db_session) -> None:
    owner, stranger = tenant_key(), tenant_key()
    job = succeeded_job(owner.headers)
    held_out = processed_file(owner.headers, chat_lines(8))
    with api() as client:
        created = client.post(f"/v1/fine_tuning/jobs/{job.id}/evaluations", headers=owner.headers,
                              json={"file": held_out, "max_samples": ROWS})
        assert created.status_code == 200, created.text
        first = created.json()
        assert (first["object"], first["status"], first["file"], first["max_samples"], first["grader"]) == (
            "fine_tuning.job.evaluation", "queued", held_out, ROWS, DEFAULT_GRADER)
        done = wait_evaluation(client, owner.headers, job.id, first["id"])
        assert done["status"] == "succeeded", done
        assert done["results"] == {
            "base": {"model": "tunefleet-tiny-llama", "score": 0.0, "count": ROWS, "errors": 0},
            "fine_tuned": {"model": job.fine_tuned_model, "score": (ROWS - 1) / ROWS, "count": ROWS, "errors": 0}}
        assert done["progress"] == {"answered": 2 * ROWS, "total": 2 * ROWS}
        assert [(s["line"], s["prompt"], s["reference"], s["base"]["answer"], s["fine_tuned"]["answer"],
                 s["fine_tuned"]["reward"]) for s in done["samples"][:2]] == [
            (1, "What is 0 plus 0?", "0", "It is 0.", "zero", 0.0),
            (2, "What is 1 plus 1?", "2", "It is 2.", "2", 1.0)]

        # Through the completion path, as the job's organization, greedy: the base rows
        # first, then the fine-tuned ones, each prompt the row's messages before its answer.
        asked = engine.requests
        assert [r.adapter is not None for r in asked] == [False] * ROWS + [True] * ROWS
        assert {(r.tenant, r.sampling.temperature, r.sampling.max_tokens) for r in asked} == {(owner.tenant_id, 0.0,
                                                                                                64)}
        assert asked[1].messages == ({"role": "system", "content": "You answer briefly."},
                                     {"role": "user", "content": "What is 1 plus 1?"})
        events = [e.message for e in db_session.query(JobEvent).filter(JobEvent.job_id == job.id)]
        assert f"Held-out exact match: base 0% -> fine-tuned 80% on {ROWS} rows ({first['id']}, {held_out})" in events

        listed = client.get(f"/v1/fine_tuning/jobs/{job.id}/evaluations", headers=owner.headers).json()
        assert [e["id"] for e in listed["data"]] == [first["id"]] and listed["data"][0]["status"] == "succeeded"

        # A reinforcement file: no reference, so a grader reads what its lines hold.
        prompts = "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}],
                                      "answer": str(2 * i)}) + "\n" for i in (3, 4))
        rl_file = processed_file(owner.headers, prompts.encode())
        url = f"/v1/fine_tuning/jobs/{job.id}/evaluations"
        missing = client.post(url, headers=owner.headers, json={"file": rl_file})
        assert (missing.status_code, missing.json()["error"]["code"], missing.json()["error"]["param"]) == (
            400, "grader_item_missing", "grader.reference")
        grader = {"type": "string_check", "name": "answer", "operation": "eq", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}"}
        graded = client.post(url, headers=owner.headers, json={"file": rl_file, "grader": grader}).json()
        graded = wait_evaluation(client, owner.headers, job.id, graded["id"])
        assert (graded["max_samples"], graded["results"]["base"]["score"], graded["results"]["fine_tuned"]["score"]) \
            == (2, 0.0, 1.0)

        # Another organization's key sees none of it, and cannot start one.
        for response in (client.get(url, headers=stranger.headers),
                         client.get(f"{url}/{first['id']}", headers=stranger.headers),
                         client.post(url, headers=stranger.headers, json={"file": held_out})):
            assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def test_what_cannot_be_evaluated_is_a_clear_4xx(api, engine, tenant_key, succeeded_job, make_job, processed_file,
                                                 upload, inline_queue) -> None:
    owner, stranger = tenant_key(), tenant_key()
    job = succeeded_job(owner.headers)
    url = f"/v1/fine_tuning/jobs/{job.id}/evaluations"
    good = processed_file(owner.headers)
    preference = processed_file(owner.headers, json.dumps({
        "input": {"messages": [{"role": "user", "content": "hi"}]},
        "preferred_output": [{"role": "assistant", "content": "hello"}],
        "non_preferred_output": [{"role": "assistant", "content": "go"}]}).encode() + b"\n")
    broken = upload(owner.headers, b'{"messages": [{"role": "user", "content": "only a question"}]}\n{x\n').json()["id"]
    inline_queue.run_validation = False
    pending = upload(owner.headers).json()["id"]
    engine.gated = True
    with api(evaluation_max_concurrent_per_tenant=1) as client:
        def refused(body: dict[str, Any], target: str = url) -> tuple[int, str, str | None]:
            response = client.post(target, headers=owner.headers, json=body)
            return response.status_code, response.json()["error"]["code"], response.json()["error"]["param"]

        running = make_job(owner.headers)
        assert refused({"file": good}, f"/v1/fine_tuning/jobs/{running['id']}/evaluations") == (
            409, "job_not_succeeded", None)
        assert refused({}) == (400, "invalid_request", "file")  # no file, no validation file
        assert refused({"file": pending}) == (400, "file_not_ready", "file")
        assert refused({"file": broken}) == (400, "invalid_file", "file")
        assert refused({"file": preference}) == (400, "invalid_file", "file")
        assert refused({"file": processed_file(stranger.headers)}) == (404, "not_found", "file")
        assert refused({"file": good, "max_samples": 201}) == (400, "too_many_samples", "max_samples")
        assert refused({"file": good, "max_samples": 0}) == (400, "invalid_request", "max_samples")
        assert refused({"file": good, "max_tokens": 4096}) == (400, "invalid_request", "max_tokens")
        assert refused({"file": good, "grader": {"type": "string_check", "input": "x", "reference": "y",
                                                 "operation": "is"}}) == (400, "invalid_grader", "grader.operation")
        assert refused({"file": good, "grader": {"type": "score_model", "name": "judge", "model": "nope",
                                                 "input": [{"role": "user", "content": "{{sample.output_text}}"}]}}) \
            == (400, "invalid_grader_model", "grader.model")
        held = client.post(url, headers=owner.headers, json={"file": good, "max_samples": 1})
        assert held.status_code == 200, held.text
        busy = client.post(url, headers=owner.headers, json={"file": good})
        assert (busy.status_code, busy.json()["error"]["code"], busy.headers["Retry-After"]) == (
            429, "too_many_evaluations", "30")
        engine.release()
        assert wait_evaluation(client, owner.headers, job.id, held.json()["id"])["status"] == "succeeded"
        assert client.post(url, headers=owner.headers, json={"file": good, "max_samples": 1}).status_code == 200


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_an_evaluation_under_way_when_its_api_process_stops_is_taken_over(api, engine, tenant_key, succeeded_job,
                                                                          processed_file, db_session) -> None:
    owner = tenant_key()
    job = succeeded_job(owner.headers)
    held_out = processed_file(owner.headers)
    url = f"/v1/fine_tuning/jobs/{job.id}/evaluations"
    engine.gated = True
    with api() as client:
        crashed, elsewhere = (client.post(url, headers=owner.headers, json={"file": held_out, "max_samples": 2}).json()
                              for _ in range(2))
        assert engine.wait_requests(2), "the evaluations did not start"
    # A clean stop gives them back: queued, unheld.
    rows = {row.id: row for row in db_session.query(Evaluation).filter(Evaluation.job_id == job.id)}
    assert {(row.status, row.runner, row.attempts) for row in rows.values()} == {("queued", None, 1)}

    # One was running in a process of this machine that is gone (kill -9), the other runs
    # in a live process elsewhere (a fresh heartbeat).
    rows[crashed["id"]].status, rows[crashed["id"]].runner = "running", f"{socket.gethostname()}:{_dead_pid()}:0"
    rows[elsewhere["id"]].status, rows[elsewhere["id"]].runner = "running", "another-host:1:0"
    for row in rows.values():
        row.heartbeat_at = utcnow()
    db_session.commit()
    engine.release()
    with api() as client:  # the next start takes over the crashed one at once, not the live one
        resumed = wait_evaluation(client, owner.headers, job.id, crashed["id"])
        assert resumed["status"] == "succeeded" and resumed["results"]["fine_tuned"]["score"] == 0.5, resumed
        assert client.get(f"{url}/{elsewhere['id']}", headers=owner.headers).json()["status"] == "running"

        # Its heartbeat stops: it is taken over, and one interrupted too often fails, saying why.
        db_session.expire_all()
        row = db_session.get_one(Evaluation, elsewhere["id"])
        row.heartbeat_at, row.attempts = utcnow().replace(year=2020), 3
        db_session.commit()
        failed = wait_evaluation(client, owner.headers, job.id, elsewhere["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "evaluation_interrupted", failed
    assert db_session.get_one(Evaluation, crashed["id"]).attempts == 2
    events = [e.message for e in db_session.query(JobEvent).filter(JobEvent.job_id == job.id)]
    assert any(m.startswith(f"Held-out evaluation {elsewhere['id']} failed: evaluation_interrupted") for m in events)


# ---- the pure parts -------------------------------------------------------------------------


def test_rows_split_at_the_last_answer_and_items_carry_the_reference() -> None:
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "weight": 1}],
            "id": 7}
    lines = [json.dumps(chat).encode(), b"", json.dumps(chat).encode()]
    rows = evaluation_rows([b"\n".join(lines)], "chat", limit=1)
    assert len(rows) == 1 and rows[0].line == 1 and rows[0].reference == "d"
    assert rows[0].messages == ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                {"role": "user", "content": "c"})
    assert rows[0].item == {**chat, "reference": "d"}
    assert [r.line for r in evaluation_rows([b"\n".join(lines)], "chat", limit=5)] == [1, 3]
    (alpaca,) = evaluation_rows([json.dumps({"instruction": "i", "input": "x", "output": "o"}).encode()], "alpaca", 9)
    assert (alpaca.messages, alpaca.reference) == (({"role": "user", "content": "i\n\nx"},), "o")
    with pytest.raises(ValueError, match="preference"):
        evaluation_rows([b"{}"], "preference", 1)


def test_scores_count_unanswered_and_ungraded_rows_as_errors() -> None:
    from api.evaluations.results import Answer

    graded, failed = GradeResult("g", "string_check", reward=1.0), GradeResult("g", "string_check")
    failed.errors.invalid_variable_error = True
    score = model_score("m", [Answer("x"), Answer("y"), Answer(None, error="context_length_exceeded: too long")],
                        [graded, failed, None])
    assert score == {"model": "m", "score": 1 / 3, "count": 3, "errors": 2}
    assert (format_score(DEFAULT_GRADER, 0.025), format_score({"type": "python"}, 0.5)) == ("2.5%", "0.500")
    results = {"base": {"score": 0.0, "count": 20}, "fine_tuned": {"score": 0.85, "count": 20}}
    assert (summary(DEFAULT_GRADER, results, from_parent=False)
            == "Held-out exact match: base 0% -> fine-tuned 85% on 20 rows")
    # A job that continues a fine-tuned model starts from its parent, and the event says so.
    assert (summary(DEFAULT_GRADER, results, from_parent=True)
            == "Held-out exact match: parent 0% -> fine-tuned 85% on 20 rows")
