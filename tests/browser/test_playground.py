"""The job page's playground in Chromium against the real service and inference worker.

A job trains for real (two epochs: a checkpoint after each), then the page streams its
fine-tuned model's greedy answer next to the base model's; both columns must hold exactly
what a direct API call with the same request returns, for the final model and for an
earlier checkpoint. With the organization's completion slots all taken, the playground
shows the 429 with when to retry. Without the comparison only the fine-tuned model is asked.
The card next to the loss chart evaluates both models on a held-out file.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.browser.test_dashboard_flows import _processed_file

pytestmark = pytest.mark.browser

PROMPT = "Spell backwards: bank"
SYSTEM = "Answer with the letters only."
MAX_TOKENS = 12
# TUNEFLEET_INFERENCE_MAX_CONCURRENT_PER_TENANT's default, which the service runs with.
TENANT_SLOTS = 4
# The demo model's context is 512 tokens: PROMPT in the chat template and this many more fit.
HOLD_TOKENS = 448


@pytest.fixture(scope="module")
def trained_job(service) -> dict:
    """A succeeded job of the admin's organization with two checkpoints."""
    with service.api() as api:
        job = api.post("/v1/fine_tuning/jobs", json={
            "model": "tunefleet-tiny-llama", "training_file": _processed_file(api), "seed": 7,
            # A high learning rate, so the adapter visibly changes the greedy answer.
            "hyperparameters": {"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 20.0},
            "max_seq_len": 48,
        })
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        assert job["status"] == "succeeded", f"{job}\n{service.log_tail(80)}"
        job["checkpoints"] = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert len(job["checkpoints"]) >= 2, job["checkpoints"]
    return job


def _greedy(service, model: str, system: str | None = None, *, prompt: str = PROMPT,
            max_tokens: int = MAX_TOKENS) -> str:
    """The content of the same greedy request, asked over the API directly (not streamed)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    with service.api() as api:
        for _ in range(150):
            answer = api.post("/v1/chat/completions", json={
                "model": model, "messages": messages,
                "temperature": 0, "top_p": 1, "max_tokens": max_tokens,
            })
            if answer.status_code != 503:
                break
            time.sleep(1)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def _open_playground(page, service, job_id: str) -> list[str]:
    """Open the job page's playground for a greedy request; returns the page's script errors."""
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(f"{service.url}/ui/jobs/{job_id}")
    page.wait_for_selector("#playground:not(.hidden)")
    # Greedy by default: comparing the two models needs answers that do not vary by sampling.
    assert page.input_value("#pg-temperature") == "0"
    page.fill("#pg-prompt", PROMPT)
    page.fill("#pg-max-tokens", str(MAX_TOKENS))
    return errors


def _send_and_wait(page, service, errors: list[str]) -> None:
    page.click("#pg-send")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    finished = ("['pg-col-tuned', 'pg-col-base'].every((id) => "
                "['done', 'error'].includes(document.getElementById(id).dataset.state))")
    try:
        page.wait_for_function(finished, timeout=90_000)
    except PlaywrightTimeout:
        columns = {name: _column(page, name) for name in ("tuned", "base")}
        raise AssertionError(f"the playground did not finish: {columns}; form: "
                             f"{page.inner_text('#pg-form-error')!r}; script errors: {errors}; "
                             f"service log:\n{service.log_tail(60)}") from None


def _column(page, name: str) -> dict:
    return page.eval_on_selector(f"#pg-col-{name}", """(node) => ({
        state: node.dataset.state, model: node.dataset.model, retries: Number(node.dataset.loadingRetries),
        code: node.dataset.code || null,
        text: node.querySelector('[data-role=output]').textContent,
        status: node.querySelector('[data-role=status]').textContent})""")


def test_playground_streams_the_fine_tuned_and_base_answers(service, page_for, trained_job: dict,
                                                            screenshots: Path) -> None:
    page = page_for(service.admin_key)
    errors = _open_playground(page, service, trained_job["id"])
    # The select lists the final model first, then each checkpoint as a model of its own.
    options = page.eval_on_selector_all("#pg-model option", "(nodes) => nodes.map((o) => o.value)")
    assert options[0] == trained_job["fine_tuned_model"]
    assert sorted(options[1:]) == sorted(c["fine_tuned_model_checkpoint"] for c in trained_job["checkpoints"]
                                         if c["fine_tuned_model_checkpoint"] != trained_job["fine_tuned_model"])

    # The first completions since the service started.
    _send_and_wait(page, service, errors)
    tuned, base = _column(page, "tuned"), _column(page, "base")
    page.screenshot(path=screenshots / "20-playground-streamed.png", full_page=True)
    assert tuned["state"] == "done" and base["state"] == "done", (tuned, base)
    # The base was preloaded when the job succeeded, and a completion that finds its base
    # still loading is held until it is loaded: no 503 reaches the page to be retried.
    assert tuned["retries"] + base["retries"] == 0, (tuned, base)
    assert (tuned["model"], base["model"]) == (trained_job["fine_tuned_model"], "tunefleet-tiny-llama")
    assert tuned["text"] and base["text"]
    assert tuned["text"] == _greedy(service, trained_job["fine_tuned_model"])
    assert base["text"] == _greedy(service, "tunefleet-tiny-llama")
    assert tuned["text"] != base["text"], "the adapter changes nothing: the columns cannot be told apart"
    assert "tokens" in tuned["status"] and "finish:" in tuned["status"], tuned["status"]

    # An earlier checkpoint answers with its own adapter.
    earliest = min(trained_job["checkpoints"], key=lambda c: c["step_number"])["fine_tuned_model_checkpoint"]
    page.select_option("#pg-model", earliest)
    _send_and_wait(page, service, errors)
    checkpoint = _column(page, "tuned")
    assert checkpoint["state"] == "done" and checkpoint["model"] == earliest, checkpoint
    assert checkpoint["text"] and checkpoint["text"] == _greedy(service, earliest)

    # A system prompt goes first, as a system message, to both models.
    sent: list[dict] = []
    page.on("request", lambda request: sent.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions") else None)
    page.select_option("#pg-model", trained_job["fine_tuned_model"])
    page.fill("#pg-system", SYSTEM)
    _send_and_wait(page, service, errors)
    expected = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    assert len(sent) == 2 and all(body["messages"] == expected and body["temperature"] == 0 for body in sent), sent
    tuned, base = _column(page, "tuned"), _column(page, "base")
    assert tuned["state"] == "done" and base["state"] == "done", (tuned, base)
    assert tuned["text"] == _greedy(service, trained_job["fine_tuned_model"], system=SYSTEM)
    assert base["text"] == _greedy(service, "tunefleet-tiny-llama", system=SYSTEM)


def test_playground_shows_when_to_retry_a_429(service, page_for, trained_job: dict, screenshots: Path) -> None:
    page = page_for(service.admin_key)
    errors = _open_playground(page, service, trained_job["id"])
    # Take every completion slot of the organization: streams of the base model's greedy
    # answer to PROMPT, as long as its context allows (random weights do not end that one),
    # 16 choices each. The worker gives the four generations turns on the one base model, so
    # each of them holds its slot until nearly all of their tokens are generated; a holder
    # whose stream ends asks again at once, so a slot is free for milliseconds at most.
    stop = threading.Event()

    def hold() -> None:
        with httpx.Client(base_url=service.url, timeout=None,
                          headers={"Authorization": f"Bearer {service.admin_key}"}) as client:
            while not stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json={
                        "model": "tunefleet-tiny-llama", "messages": [{"role": "user", "content": PROMPT}],
                        "temperature": 0, "max_tokens": HOLD_TOKENS, "n": 16, "stream": True}) as held:
                    for _ in held.iter_bytes():
                        if stop.is_set():
                            break

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(TENANT_SLOTS)]
    for holder in holders:
        holder.start()
    try:
        # The slots are taken once a direct request is refused (one admitted before a
        # holder waits for the generation and times out here; it still holds a slot).
        probe = None
        with httpx.Client(base_url=service.url, timeout=3.0,
                          headers={"Authorization": f"Bearer {service.admin_key}"}) as api:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    probe = api.post("/v1/chat/completions", json={
                        "model": "tunefleet-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1})
                except httpx.TimeoutException:
                    continue
                if probe.status_code == 429:
                    break
                time.sleep(0.2)
        assert probe is not None and probe.status_code == 429, probe and probe.text
        _send_and_wait(page, service, errors)
        page.screenshot(path=screenshots / "21-playground-429.png", full_page=True)
        for name in ("tuned", "base"):
            col = _column(page, name)
            assert col["state"] == "error" and col["code"] == "too_many_requests", col
            assert col["status"].startswith(f"Too many requests, retry in {probe.headers['Retry-After']} s."), col
            assert col["text"] == ""
    finally:
        stop.set()
        for holder in holders:
            holder.join(timeout=30)


def test_playground_without_comparison_asks_the_fine_tuned_model_only(service, page_for,
                                                                     trained_job: dict) -> None:
    page = page_for(service.admin_key)
    errors = _open_playground(page, service, trained_job["id"])
    sent: list[dict] = []
    page.on("request", lambda request: sent.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions") else None)
    page.uncheck("#pg-compare")
    assert page.is_hidden("#pg-col-base")
    page.click("#pg-send")
    page.wait_for_function("['done', 'error'].includes(document.getElementById('pg-col-tuned').dataset.state)",
                           timeout=90_000)
    tuned = _column(page, "tuned")
    assert tuned["state"] == "done" and tuned["text"] == _greedy(service, trained_job["fine_tuned_model"]), tuned
    assert [body["model"] for body in sent] == [trained_job["fine_tuned_model"]], sent
    page.check("#pg-compare")
    assert page.is_visible("#pg-col-base") and not errors, errors


def test_the_job_page_evaluates_the_base_and_the_fine_tuned_model(service, page_for, trained_job: dict,
                                                                   screenshots: Path) -> None:
    """A held-out file picked in the card next to the loss chart: the card shows the API's
    scores (base -> fine-tuned), the evaluation in its table, and answers that are the
    models' greedy answers through /v1/chat/completions."""
    from tests.browser.test_dashboard_flows import _jsonl, demo_examples

    rows = demo_examples(3, seed=4)
    with service.api() as api:
        held_out = api.post("/v1/files", data={"purpose": "fine-tune"},
                            files={"file": ("held-out.jsonl", _jsonl(rows), "application/jsonl")}).json()["id"]
        deadline = time.monotonic() + 60
        while api.get(f"/v1/files/{held_out}").json()["status"] == "uploaded" and time.monotonic() < deadline:
            time.sleep(0.3)
    page = page_for(service.admin_key)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{service.url}/ui/jobs/{trained_job['id']}")
    page.wait_for_selector("#card-evaluations:not(.hidden)")
    page.wait_for_selector(f"#ev-file option[value='{held_out}']", state="attached")
    page.select_option("#ev-file", held_out)
    page.fill("#ev-max-samples", "3")
    page.click("#ev-start")
    page.wait_for_function("['succeeded', 'failed'].includes(document.getElementById('ev-latest').dataset.status)",
                           timeout=120_000)
    evaluation_id = page.get_attribute("#ev-latest", "data-id")
    with service.api() as api:
        evaluation = api.get(f"/v1/fine_tuning/jobs/{trained_job['id']}/evaluations/{evaluation_id}").json()
        events = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{trained_job['id']}/events?limit=100")
                  .json()["data"]]
    assert evaluation["status"] == "succeeded" and evaluation["file"] == held_out, evaluation
    page.click("#ev-samples-box summary")
    page.screenshot(path=screenshots / "22-held-out-evaluation.png", full_page=True)
    results = evaluation["results"]
    shown = [page.inner_text(f"#ev-latest [data-role='{role}']") for role in ("base", "fine-tuned")]
    assert shown == [f"{round(100 * results[key]['score'], 1):g}%" for key in ("base", "fine_tuned")], (shown, results)
    assert "exact match · 3 rows" in page.inner_text("#ev-latest")
    # This job trained on the base model, so that is what it is compared with (a job that
    # continues a fine-tuned model is compared with its parent, and says "parent").
    assert page.text_content("#ev-latest .who") == "base"
    assert page.text_content("#ev-table [data-role='start-label']") == "Base"  # shown upper-case by CSS
    assert page.get_attribute(f"#ev-table tr[data-id='{evaluation_id}']", "data-status") == "succeeded"
    assert any(m.startswith("Held-out exact match: base ") and evaluation_id in m for m in events), events
    # The answers are the models' own greedy answers, asked the same way.
    first = evaluation["samples"][0]
    assert first["prompt"] == rows[0]["messages"][0]["content"]
    answers = page.eval_on_selector_all("#ev-samples tbody tr:first-child .ev-answer", "(nodes) => "
                                        "nodes.map((n) => n.textContent)")
    assert answers == [rows[0]["messages"][1]["content"], first["base"]["answer"], first["fine_tuned"]["answer"]]
    for key, model in (("base", "tunefleet-tiny-llama"), ("fine_tuned", trained_job["fine_tuned_model"])):
        assert first[key]["answer"] == _greedy(service, model, prompt=first["prompt"], max_tokens=64), key
    assert not errors, errors
