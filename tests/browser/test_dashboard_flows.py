"""The dashboard in Chromium against the real service: the flows a user goes through.

Every test drives the real pages served by ``tunefleet serve`` (API + Celery worker +
scheduler + local executor) and checks what a user sees. Screenshots of every page go to
``test-output/screenshots/``.

Training is real: jobs run the fsdp_qlora trainer on a tiny Llama through the local
executor; metrics reach the page over the API's SSE stream.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

# Long enough that, on an idle machine too, the trainer reports over several 2 s flushes
# while the page watches (150 steps of the tiny model fit in one flush there).
TRAIN_STEPS = 1500


WORDS = ["able", "acid", "aged", "area", "army", "baby", "back", "ball",
         "band", "bank", "base", "bath", "bear", "beat", "bell", "belt"]


def demo_examples(n: int, seed: int = 0) -> list[dict]:
    """Chat examples of a learnable toy task: spell a word backwards."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        word = rng.choice(WORDS)
        examples.append({"messages": [
            {"role": "user", "content": f"Spell backwards: {word}"},
            {"role": "assistant", "content": word[::-1]},
        ]})
    return examples


def _jsonl(rows: list[object]) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


GOOD_FILE = _jsonl(demo_examples(48, seed=1))
BAD_FILE = _jsonl(
    [
        demo_examples(1)[0],
        '{"messages": [{"role": "user", "content": "hi"}',  # line 2: cut-off JSON
        {"messages": [{"role": "user", "content": "no answer"}]},  # line 3: no assistant turn
        demo_examples(2)[1],
    ]
)


def _upload(page, name: str, data: bytes) -> None:
    page.set_input_files("#upload-input", {"name": name, "mimeType": "application/jsonl", "buffer": data})


def _processed_file(api) -> str:
    """Upload GOOD_FILE and wait for its validation; returns the file id."""
    file = api.post("/v1/files", data={"purpose": "fine-tune"},
                    files={"file": ("train.jsonl", GOOD_FILE, "application/jsonl")}).json()
    deadline = time.monotonic() + 60
    while file["status"] == "uploaded" and time.monotonic() < deadline:
        time.sleep(0.3)
        file = api.get(f"/v1/files/{file['id']}").json()
    assert file["status"] == "processed", file
    return file["id"]


def _create_job_over_api(service, key: str, *, steps: int, model: str = "tunefleet-tiny-llama") -> str:
    with service.api(key) as api:
        job = api.post("/v1/fine_tuning/jobs", json={
            "model": model, "training_file": _processed_file(api),
            "hyperparameters": {"max_steps": steps},
        })
        assert job.status_code == 200, job.text
        return job.json()["id"]


@pytest.fixture(scope="module")
def background_jobs(service) -> dict[str, str]:
    """Jobs started early so their trainers boot while other tests run: ``long`` (the
    admin's, thousands of steps, to be cancelled) and ``broken`` (the other tenant's, on
    the broken model, fails in the trainer)."""
    jobs = {
        # Long enough to still be running when the cancel test reaches it (5,000 steps
        # of the tiny model take ~40 s on an idle machine).
        "long": _create_job_over_api(service, service.admin_key, steps=200_000),
        "broken": _create_job_over_api(service, service.other_key, steps=5, model="broken-llama"),
    }
    return jobs


def _wait_status(page, wanted: set[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = page.get_attribute("#job-status", "data-status")
        if status in wanted:
            return status
        page.wait_for_timeout(250)
    raise AssertionError(f"job page shows status {status!r}, expected one of {sorted(wanted)}")


def _loss_points(page) -> int:
    return int(page.get_attribute("#chart-loss", "data-points") or 0)


def _wait_js(page, service, expression: str, *, timeout_ms: int, what: str) -> None:
    """Wait for a page condition of a live job; on timeout, say what the service logged
    (a 2-core CI machine runs three trainers beside Chromium here)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(expression, timeout=timeout_ms)
    except PlaywrightTimeout:
        raise AssertionError(f"timed out waiting for {what}; service log:\n{service.log_tail(120)}") from None


def test_login_rejects_a_wrong_key(service, browser, screenshots: Path) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True)
    page = context.new_page()
    page.goto(f"{service.url}/ui/jobs/ftjob-x")
    assert "/ui/login" in page.url
    page.screenshot(path=screenshots / "01-login.png")
    page.fill("input[name=api_key]", "tf_AAAAAAAA_" + "B" * 32)
    page.click("button[type=submit]")
    assert "not valid" in page.inner_text("[data-testid=login-error]")
    assert not [c for c in context.cookies() if c["name"] == "tf_session"]
    context.close()


def test_a_new_organization_sees_empty_states(service, page_for, screenshots: Path) -> None:
    with service.api() as api:
        tenant = api.post("/v1/admin/tenants", json={"name": "fresh-org"}).json()
        key = api.post(f"/v1/admin/tenants/{tenant['id']}/api_keys", json={}).json()["key"]
    page = page_for(key)
    empty = page.wait_for_selector("#jobs-empty .empty")
    assert "No fine-tuning jobs yet" in empty.inner_text()
    # The counters come from their own requests, after the list may already show: wait
    # until the placeholder is replaced (reading it at once was a race, seen in CI).
    page.wait_for_function("""() => document.querySelector('[data-count="running"]').textContent !== '—'""")
    assert page.inner_text('[data-count="running"]') == "0"
    page.screenshot(path=screenshots / "02-jobs-empty.png", full_page=True)
    page.goto(f"{service.url}/ui/pools")
    assert "The queue is empty" in page.wait_for_selector("#queue-empty .empty").inner_text()


def test_submit_watch_training_and_download_adapter(
    service, page_for, screenshots: Path, background_jobs: dict[str, str]
) -> None:
    page = page_for(service.admin_key)
    page.wait_for_selector(f'tr[data-job-id="{background_jobs["long"]}"]')
    page.screenshot(path=screenshots / "02b-jobs-list-running.png", full_page=True)

    # 1. A file with errors: the line-numbered problems show inline, nothing is queued.
    page.click("text=New job")
    page.wait_for_url("**/ui/new")
    _upload(page, "broken.jsonl", BAD_FILE)
    problems = page.wait_for_selector("[data-testid=validation-errors] .problems", timeout=60_000)
    lines = [li.get_attribute("data-line") for li in problems.query_selector_all("li")]
    assert "2" in lines and "3" in lines, lines
    text = problems.inner_text()
    assert "line 2" in text and "line 3" in text
    assert "invalid_json" in text
    page.screenshot(path=screenshots / "03-new-job-invalid-file.png", full_page=True)

    # 2. A valid file: counts, the resolved "auto" values, the estimate.
    _upload(page, "reverse-words.jsonl", GOOD_FILE)
    ok = page.wait_for_selector("[data-testid=validation-ok]", timeout=60_000)
    assert "48 examples" in ok.inner_text()
    page.select_option("#model-select", "tunefleet-tiny-llama")
    page.fill("input[name=max_steps]", str(TRAIN_STEPS))
    # 48 examples: "auto" is 3 epochs of batch 1 (control/jobs/hyperparameters.py); max_steps caps it.
    page.wait_for_function(
        f"document.querySelector('[data-resolved=total_steps]').textContent"
        f".startsWith('{TRAIN_STEPS:,} optimizer steps')"
    )
    assert page.inner_text("[data-resolved=n_epochs]") == "auto → 3"
    assert page.inner_text("[data-resolved=batch_size]") == "auto → 1"
    # The estimate preview: a dry run of placement (POST /v1/fine_tuning/estimate) picks
    # the embedded `local` pool, with a memory bar per pool.
    choice = page.wait_for_selector("[data-testid=estimate-choice]", timeout=30_000)
    assert "on pool" in choice.inner_text() and "local" in choice.inner_text(), choice.inner_text()
    assert page.query_selector("#estimate .meter-row[data-pool=local]") is not None
    page.screenshot(path=screenshots / "04-new-job-estimate.png", full_page=True)

    # 3. Submit: the job page opens and its loss chart gains points while it trains.
    page.click("#submit-job")
    page.wait_for_url(re.compile(r".*/ui/jobs/ftjob-[A-Za-z0-9]+$"))
    job_id = page.url.rsplit("/", 1)[1]
    page.wait_for_function("Number(document.querySelector('#chart-loss').dataset.points || 0) >= 1",
                           timeout=90_000)
    first = _loss_points(page)
    page.evaluate("window.__sameDocument = true")  # gone if anything reloads the page
    _wait_js(page, service, f"Number(document.querySelector('#chart-loss').dataset.points || 0) > {first}",
             timeout_ms=120_000, what="the loss chart to gain a point")
    assert page.get_attribute("#job-status", "data-status") in {"running", "succeeded"}
    page.screenshot(path=screenshots / "05-job-running.png", full_page=True)
    # The points came over SSE into the same document, not through a reload.
    assert page.evaluate("window.__sameDocument === true")

    # 4. It succeeds; the chart holds every step; the adapter downloads with its sha256.
    assert _wait_status(page, {"succeeded", "failed"}, timeout_s=300) == "succeeded", service.log_tail()
    page.wait_for_function(
        f"Number(document.querySelector('#chart-loss').dataset.points || 0) >= {TRAIN_STEPS}"
    )
    # Each step's MFU (admission stored its basis: the model's FLOPs and the slot's peak)
    # and the job's means over its steps.
    page.wait_for_function(
        f"Number(document.querySelector('#chart-mfu').dataset.points || 0) >= {TRAIN_STEPS}"
    )
    page.wait_for_function("/^mean \\d+\\.\\d% · [\\d,.]+ tokens\\/s$/"
                           ".test(document.querySelector('#throughput-means').textContent)")
    # The final checkpoint is listed (step column). Read in the page, in one go: the live
    # page re-renders the table, and a row handle read after that is detached (its text
    # then loses the cell tabs).
    page.wait_for_function(
        "[...document.querySelectorAll('#checkpoints-table tbody tr td:nth-child(2)')]"
        f".some((td) => td.textContent.trim() === '{TRAIN_STEPS}')"
    )
    # Locators, not element handles: the live page may re-render the table in between.
    row = page.locator('#artifacts-table tr[data-name="adapter/adapter_model.safetensors"]')
    row.wait_for()
    shown_sha = row.locator("[data-sha256]").get_attribute("data-sha256")
    page.screenshot(path=screenshots / "06-job-succeeded.png", full_page=True)
    with page.expect_download() as download_info:
        row.locator("a").first.click()
    path = download_info.value.path()
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    with service.api() as api:
        listed = {a["name"]: a for a in api.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts").json()["data"]}
    assert digest == shown_sha == listed["adapter/adapter_model.safetensors"]["sha256"]

    # The jobs table shows it with progress and its last loss.
    page.goto(f"{service.url}/ui/")
    cells = page.wait_for_selector(f'tr[data-job-id="{job_id}"]')
    assert cells.get_attribute("data-status") == "succeeded"
    assert f"{TRAIN_STEPS} / {TRAIN_STEPS}" in cells.inner_text()
    page.screenshot(path=screenshots / "07-jobs-list.png", full_page=True)
    page.goto(f"{service.url}/ui/pools")
    page.wait_for_selector("#chart-util")
    page.wait_for_timeout(800)
    page.screenshot(path=screenshots / "08-queue-and-pools.png", full_page=True)
    # Each pool card has its per-node view, as the API reports it (embedded: the pools file).
    with service.api() as api:
        pools = api.get("/v1/node_pools").json()["data"]
    for pool in pools:
        card = page.locator(f'[data-pool="{pool["name"]}"]')
        assert card.get_attribute("data-capacity-source") == pool["capacity_source"] == "config"
        assert card.locator("[data-node]").count() == len(pool["node_list"]) >= 1
        assert f'/ {pool["gpus_total"]}' in card.inner_text()


def test_cancel_a_running_job_from_its_page(
    service, page_for, screenshots: Path, background_jobs: dict[str, str]
) -> None:
    job_id = background_jobs["long"]
    page = page_for(service.admin_key)
    # The jobs table follows the training without a reload.
    label = f'tr[data-job-id="{job_id}"] .progress-label'
    page.wait_for_function(f"/^[0-9]+ \\/ 200000$/.test(document.querySelector('{label}')?.textContent)",
                           timeout=90_000)
    before = page.inner_text(label)
    _wait_js(page, service, f"document.querySelector('{label}').textContent !== '{before}'",
             timeout_ms=120_000, what="the jobs table to show progress")
    page.goto(f"{service.url}/ui/jobs/{job_id}")
    _wait_status(page, {"running"}, timeout_s=90)
    page.wait_for_function("Number(document.querySelector('#chart-loss').dataset.points || 0) >= 1",
                           timeout=60_000)
    page.click("#btn-cancel")
    dialog = page.wait_for_selector("[data-testid=confirm-dialog]")
    page.screenshot(path=screenshots / "09-cancel-confirmation.png")
    dialog.query_selector('[data-action="confirm"]').click()
    assert _wait_status(page, {"cancelled"}, timeout_s=60) == "cancelled"
    assert page.is_hidden("#btn-cancel")
    page.screenshot(path=screenshots / "10-job-cancelled.png", full_page=True)
    with service.api() as api:
        assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"


def test_another_tenants_job_is_not_found(
    service, page_for, screenshots: Path, background_jobs: dict[str, str]
) -> None:
    job_id = background_jobs["long"]  # the admin organization's job
    page = page_for(service.other_key)
    assert page.inner_text("[data-testid=tenant-name]") == "other-org"
    response = page.goto(f"{service.url}/ui/jobs/{job_id}")
    assert response.status == 404
    assert "Job not found" in page.inner_text("[data-testid=not-found]")
    page.screenshot(path=screenshots / "11-other-tenant-not-found.png", full_page=True)
    # Its own list does not show the job either, and the JSON API agrees.
    page.goto(f"{service.url}/ui/")
    page.wait_for_selector(f'tr[data-job-id="{background_jobs["broken"]}"]')
    assert page.query_selector(f'tr[data-job-id="{job_id}"]') is None
    answer = page.request.get(f"{service.url}/v1/fine_tuning/jobs/{job_id}")
    assert answer.status == 404


def test_cookie_session_needs_csrf_for_unsafe_api_calls(service, page_for) -> None:
    page = page_for(service.other_key)
    # The session cookie authenticates GETs of the JSON API...
    assert page.request.get(f"{service.url}/v1/fine_tuning/jobs").status == 200
    # ...but a cookie-only POST without the page's CSRF token is refused.
    refused = page.request.post(f"{service.url}/v1/files", multipart={
        "purpose": "fine-tune",
        "file": {"name": "x.jsonl", "mimeType": "application/jsonl", "buffer": GOOD_FILE},
    })
    assert refused.status == 403
    assert refused.json()["error"]["code"] == "csrf_failed"
    token = page.get_attribute('meta[name="csrf-token"]', "content")
    accepted = page.request.post(f"{service.url}/v1/files", headers={"X-CSRF-Token": token}, multipart={
        "purpose": "fine-tune",
        "file": {"name": "x.jsonl", "mimeType": "application/jsonl", "buffer": GOOD_FILE},
    })
    assert accepted.status == 200, accepted.text()
    # Logging out ends the session for the API too.
    page.click("text=Sign out")
    page.wait_for_url("**/ui/login")
    assert page.request.get(f"{service.url}/v1/fine_tuning/jobs").status == 401


def test_api_unreachable_shows_a_banner(service, page_for, screenshots: Path) -> None:
    page = page_for(service.other_key)
    page.route("**/ui/api/jobs**", lambda route: route.abort("connectionrefused"))
    banner = page.wait_for_selector("#api-banner.show", timeout=10_000)
    assert "Cannot reach the tunefleet API" in banner.inner_text()
    page.screenshot(path=screenshots / "12-api-unreachable.png")
    page.unroute("**/ui/api/jobs**")
    page.wait_for_selector("#api-banner:not(.show)", state="attached", timeout=10_000)


def test_failed_job_shows_its_error_code(
    service, page_for, screenshots: Path, background_jobs: dict[str, str]
) -> None:
    job_id = background_jobs["broken"]
    page = page_for(service.other_key)
    page.goto(f"{service.url}/ui/jobs/{job_id}")
    assert _wait_status(page, {"failed", "succeeded"}, timeout_s=120) == "failed"
    error = page.wait_for_selector("[data-testid=job-error]")
    assert "corrupt_model" in error.inner_text()
    assert page.is_hidden("#btn-cancel")
    page.screenshot(path=screenshots / "13-job-failed.png", full_page=True)
    page.goto(f"{service.url}/ui/?status=failed")
    row = page.wait_for_selector(f'tr[data-job-id="{job_id}"]')
    assert row.get_attribute("data-status") == "failed"


def test_an_admin_opens_another_organizations_job(
    service, page_for, screenshots: Path, background_jobs: dict[str, str]
) -> None:
    job_id = background_jobs["broken"]  # other-org's job
    page = page_for(service.admin_key)
    page.goto(f"{service.url}/ui/?tenant=")
    page.click(f'tr[data-job-id="{job_id}"] a')
    page.wait_for_url(f"**/ui/jobs/{job_id}")
    assert page.inner_text("[data-testid=job-owner]") == "other-org"
    # The page's data comes through the same job routes, which open for admins too.
    assert _wait_status(page, {"failed", "succeeded"}, timeout_s=120) == "failed"
    assert "corrupt_model" in page.wait_for_selector("[data-testid=job-error]").inner_text()
    page.screenshot(path=screenshots / "14-admin-sees-another-organizations-job.png", full_page=True)
    # Its own organization's job shows no owner tag.
    page.goto(f"{service.url}/ui/jobs/{background_jobs['long']}")
    assert page.query_selector("[data-testid=job-owner]") is None


def test_a_waiting_job_shows_the_schedulers_reason_and_position(service, page_for, screenshots: Path) -> None:
    """A job that asks for more GPUs than the local pool has waits; its page and the queue
    show the scheduler's own reason and position (not numbers made up in the browser)."""
    with service.api(service.other_key) as api:
        job = api.post("/v1/fine_tuning/jobs", json={
            "model": "tunefleet-tiny-llama", "training_file": _processed_file(api), "priority": "low",
            # No pool holds 64 GPUs: the job would be refused (no_pool_fits) unless it asks to wait.
            "placement": {"gpus": 64, "queue_if_unfit": True}, "hyperparameters": {"max_steps": 5},
        })
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        try:
            deadline = time.monotonic() + 60
            while (seen := api.get(f"/v1/fine_tuning/jobs/{job_id}").json())["queue_position"] is None:
                assert time.monotonic() < deadline, seen
                time.sleep(0.5)
            assert seen["status"] == "queued", seen
            assert seen["queue_reason"].endswith(f"position {seen['queue_position']} in queue"), seen
            page = page_for(service.other_key)
            page.goto(f"{service.url}/ui/jobs/{job_id}")
            notice = page.wait_for_selector("[data-testid=queue-reason]")
            assert seen["queue_reason"] in notice.inner_text()
            page.screenshot(path=screenshots / "15-job-waiting-with-reason.png", full_page=True)
            page.goto(f"{service.url}/ui/pools")
            row = page.wait_for_selector(f'#queue-table tr[data-job-id="{job_id}"]')
            assert row.inner_text().split("\t")[0].strip() == str(seen["queue_position"])
            assert seen["queue_reason"] in row.inner_text()
        finally:
            api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")


def test_a_dpo_job_charts_its_reward_metrics(service, page_for, screenshots: Path) -> None:
    """A DPO job's page shows the reward charts, filled from the trainer's reward metrics
    (train, and valid from its held-out file) until it succeeds."""
    from tests.preference_data import sum_preference_lines

    with service.api() as api:
        files = []
        for name, data in (("prefs.jsonl", sum_preference_lines(16)),
                           ("held.jsonl", sum_preference_lines(8, start=16))):
            file = api.post("/v1/files", data={"purpose": "fine-tune"},
                            files={"file": (name, data, "application/jsonl")}).json()
            files.append(file["id"])
        job = api.post("/v1/fine_tuning/jobs", json={
            "model": "tunefleet-tiny-llama", "training_file": files[0], "validation_file": files[1],
            "trainer": "fsdp_qlora", "max_seq_len": 48,
            "method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}}})
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
    page = page_for(service.admin_key)
    page.goto(f"{service.url}/ui/jobs/{job_id}")
    page.wait_for_selector("#card-reward-accuracy:not(.hidden)")
    # beta shows "auto" until the service has validated the files and resolved the job's
    # hyperparameters (then 0.1, OpenAI's default); the page follows the job as it polls.
    # The validation task queues behind the module's other jobs on the serve's one worker:
    # 60 s was once not enough on a 2-core machine without AVX-512 running the whole suite.
    _wait_js(page, service, "document.querySelector('#job-details').innerText.includes('DPO · β 0.1')",
             timeout_ms=180_000, what="the details to show the resolved beta")
    assert _wait_status(page, {"succeeded", "failed"}, timeout_s=240) == "succeeded", service.log_tail(120)
    _wait_js(page, service, "Number(document.querySelector('#chart-reward-accuracy').dataset.points || 0) >= 4",
             timeout_ms=30_000, what="the reward accuracy chart to hold every step")
    assert int(page.get_attribute("#chart-rewards", "data-points") or 0) == 4
    legend = page.inner_text("#card-rewards")
    assert all(label in legend for label in ("chosen", "rejected", "margin", "valid margin"))
    page.screenshot(path=screenshots / "dpo-job-rewards.png", full_page=True)


def test_a_dpo_job_from_the_new_job_form(service, page_for, screenshots: Path) -> None:
    """The form sends a DPO job as OpenAI's method.dpo with its hyperparameters (beta too);
    its page then charts only the series that have data (no validation file: no valid
    lines) and names the CPU pool's units slots."""
    from tests.preference_data import sum_preference_lines

    page = page_for(service.admin_key)
    page.goto(f"{service.url}/ui/new")
    assert not page.is_visible("[data-testid=preference-help]")
    page.click("#training-method label:has-text('DPO')")
    help_text = page.inner_text("[data-testid=preference-help]")
    assert all(key in help_text for key in ("input", "preferred_output", "non_preferred_output")), help_text
    _upload(page, "prefs.jsonl", sum_preference_lines(16))
    ok = page.wait_for_selector("[data-testid=validation-ok]", timeout=60_000)
    assert "Format preference" in ok.inner_text() and "16 examples" in ok.inner_text(), ok.inner_text()
    page.select_option("#model-select", "tunefleet-tiny-llama")
    page.select_option("select[name=trainer]", "fsdp_qlora")
    page.fill("input[name=max_seq_len]", "48")
    page.fill("input[name=n_epochs]", "1")
    page.fill("input[name=batch_size]", "4")
    page.wait_for_function("document.querySelector('[data-resolved=beta]').textContent === 'auto → 0.1'")
    # Out of OpenAI's range (0 < beta <= 2): refused before anything is sent.
    page.fill("input[name=beta]", "2.5")
    page.click("#submit-job")
    assert "Beta must be above 0 and at most 2" in page.inner_text("[data-testid=submit-error]")
    page.fill("input[name=beta]", "0.2")
    page.wait_for_selector("[data-testid=estimate-choice]", timeout=30_000)
    page.screenshot(path=screenshots / "04b-new-dpo-job.png", full_page=True)
    with page.expect_request(lambda r: r.url.endswith("/v1/fine_tuning/jobs") and r.method == "POST") as sent:
        page.click("#submit-job")
    body = sent.value.post_data_json
    assert "hyperparameters" not in body, body
    assert body["method"] == {"type": "dpo", "dpo": {"hyperparameters": {
        "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": "auto", "beta": 0.2}}}, body
    page.wait_for_url(re.compile(r".*/ui/jobs/ftjob-[A-Za-z0-9]+$"))
    _wait_js(page, service, "document.querySelector('#job-details').innerText.includes('DPO · β 0.2')",
             timeout_ms=30_000, what="the details to show the job's beta")
    assert _wait_status(page, {"succeeded", "failed"}, timeout_s=300) == "succeeded", service.log_tail(120)
    _wait_js(page, service, "Number(document.querySelector('#chart-rewards').dataset.points || 0) >= 4",
             timeout_ms=30_000, what="the rewards chart to hold every step")
    assert page.get_attribute("#chart-rewards", "data-series") == "chosen,rejected,margin"
    assert page.get_attribute("#chart-reward-accuracy", "data-series") == "train"
    assert page.get_attribute("#chart-loss", "data-series") == "train"
    assert "valid" not in page.inner_text("#card-rewards")
    # The embedded pool is a CPU pool: its units are slots, not GPUs.
    terms = page.eval_on_selector_all("#job-details dt", "(nodes) => nodes.map((n) => n.textContent)")
    assert "Slots" in terms and "GPUs" not in terms and "GPU time" not in terms, terms
    # Memory ticks over a narrow range tell the ticks apart.
    ticks = page.evaluate("[1.50e9, 1.52e9, 1.54e9, 1.56e9].map((v, _, all) => tf.fmt.bytesTick(v, all))")
    assert ticks == ["1.40 GiB", "1.42 GiB", "1.43 GiB", "1.45 GiB"], ticks
    page.screenshot(path=screenshots / "dpo-job-from-form.png", full_page=True)

    page.goto(f"{service.url}/ui/pools")
    card = page.locator('[data-pool="local"]')
    card.wait_for()
    assert card.get_attribute("data-accelerator") == "cpu"
    text = card.inner_text()
    assert "Slots" in text and "per slot" in text and "slots/node" in text and "GPU" not in text, text
    page.wait_for_selector("#chart-util")
    assert page.inner_text("#util-unit") == "Slots"
