"""The `tunefleet` client commands against the running service, human and --json output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.preference_data import sum_preference_lines
from tests.sdk.conftest import BAD_JSONL, DEMO_MODEL, JobDriver, Service, chat_jsonl, queued_job, terminal_width
from tunefleet.cli.render import fmt_bytes, fmt_seconds


def js(result: Any) -> Any:
    return json.loads(result.stdout)


def test_files_commands(cli: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(chat_jsonl(4))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(BAD_JSONL)

    uploaded = js(cli("files", "upload", str(good), "--json"))
    assert uploaded["status"] == "processed" and uploaded["validation"]["n_examples"] == 4

    human = cli("files", "upload", str(bad), code=3)
    assert "validation errors" in human.stdout and "unrecognized_role" in human.stdout
    assert "invalid_json" in human.stdout
    rejected = js(cli("files", "upload", str(bad), "--json", code=3))
    assert {(e["line"], e["code"]) for e in rejected["validation"]["errors"]} >= {
        (2, "unrecognized_role"), (3, "invalid_json")}

    listed = js(cli("files", "list", "--json", "--limit", "2"))
    assert len(listed["data"]) == 2 and listed["has_more"] is True
    everything = js(cli("files", "list", "--json", "--all", "--limit", "1"))
    assert everything["data"][-1]["id"] == uploaded["id"] and len(everything["data"]) == 3
    assert js(cli("files", "get", uploaded["id"], "--json"))["filename"] == "good.jsonl"
    assert cli("files", "content", uploaded["id"]).stdout.encode() == good.read_bytes()
    assert js(cli("files", "delete", uploaded["id"], "--json"))["deleted"] is True

    missing = cli("files", "get", uploaded["id"], "--json", code=1)
    assert json.loads(missing.stderr)["error"]["code"] == "not_found"
    assert "not_found" in cli("files", "get", uploaded["id"], code=1).stderr


def test_jobs_commands(cli: Any, service: Service, tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_bytes(chat_jsonl(4))
    job = js(cli("jobs", "create", "-m", DEMO_MODEL, "-t", str(data), "--n-epochs", "2", "--r", "4",
                 "--metadata", "team=nlp", "--priority", "high", "--json"))
    assert job["status"] == "queued" and job["hyperparameters"]["n_epochs"] == 2
    assert job["adapter"]["r"] == 4 and job["metadata"] == {"team": "nlp"} and job["priority"] == 75
    bad = cli("jobs", "create", "-m", "nope", "-t", job["training_file"], "--json", code=1)
    assert json.loads(bad.stderr)["error"]["param"] == "model"

    assert [j["id"] for j in js(cli("jobs", "list", "--json"))["data"]] == [job["id"]]
    assert js(cli("jobs", "list", "--status", "running", "--json"))["data"] == []
    assert len(js(cli("jobs", "list", "--status", "queued", "--metadata", "team=nlp", "--json"))["data"]) == 1
    assert js(cli("jobs", "get", job["id"], "--json"))["id"] == job["id"]
    assert "queued" in cli("jobs", "get", job["id"]).stdout
    assert js(cli("jobs", "pause", job["id"], "--json"))["status"] == "paused"
    assert js(cli("jobs", "resume", job["id"], "--json"))["status"] == "queued"

    driver = JobDriver(service, job["id"])
    driver.start()
    driver.write_log("line a\nline b\n")
    driver.report(driver.metric(1, 2, 3.0), driver.metric(2, 2, 2.5),
                  {"type": "checkpoint", "step": 2, "location": driver.checkpoint_location(2),
                   "metrics": {"train_loss": 2.5}},
                  driver.write_outputs({"adapter/adapter_model.safetensors": b"weights" * 10,
                                        "metrics.jsonl": b"{}\n"}))
    driver.finish("succeeded")

    assert js(cli("jobs", "wait", job["id"], "--timeout", "5", "--json"))["status"] == "succeeded"
    assert [m["train_loss"] for m in js(cli("jobs", "metrics", job["id"], "--json"))["data"]] == [3.0, 2.5]
    (ckpt,) = js(cli("jobs", "checkpoints", job["id"], "--json"))["data"]
    assert ckpt["step_number"] == 2
    events = js(cli("jobs", "events", job["id"], "--json", "--all"))["data"]
    assert any(e["message"].startswith("Checkpoint created") for e in events)
    assert js(cli("jobs", "logs", job["id"], "--json", "--tail", "1"))["lines"] == ["line b"]
    assert cli("jobs", "logs", job["id"]).stdout == "line a\nline b\n"
    dl = js(cli("jobs", "download", job["id"], "-o", str(tmp_path / "out"), "--prefix", "adapter/", "--json"))
    assert [f["name"] for f in dl["files"]] == ["adapter/adapter_model.safetensors"]
    assert (tmp_path / "out/adapter/adapter_model.safetensors").read_bytes() == b"weights" * 10

    conflict = cli("jobs", "cancel", job["id"], "--json", code=1)
    assert json.loads(conflict.stderr)["error"]["code"] == "invalid_state_transition"
    models = js(cli("models", "--json"))["data"]
    assert DEMO_MODEL in [m["id"] for m in models]


def test_create_takes_the_method_and_its_hyperparameters(cli: Any, tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(sum_preference_lines(8))
    dpo = js(cli("jobs", "create", "-m", DEMO_MODEL, "-t", str(pairs), "--training-method", "dpo", "--beta", "0.2",
                 "--learning-rate-multiplier", "2", "--n-epochs", "1", "--json"))
    assert dpo["method"]["type"] == "dpo"
    hp = dpo["method"]["dpo"]["hyperparameters"]
    assert hp["beta"] == 0.2 and hp["learning_rate_multiplier"] == 2 and hp["n_epochs"] == 1

    chat = tmp_path / "chat.jsonl"
    chat.write_bytes(chat_jsonl(4))
    sft = js(cli("jobs", "create", "-m", DEMO_MODEL, "-t", str(chat), "--learning-rate-multiplier", "0.5", "--json"))
    assert sft["method"]["type"] == "supervised" and sft["hyperparameters"]["learning_rate_multiplier"] == 0.5

    no_dpo = cli("jobs", "create", "-m", DEMO_MODEL, "-t", str(chat), "--beta", "0.1", code=2)
    assert "--training-method dpo" in no_dpo.stderr


def test_a_missing_key_points_at_login(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNEFLEET_API_KEY")
    denied = cli("jobs", "list", "--json", code=1)
    error = json.loads(denied.stderr)["error"]
    assert error["code"] == "missing_api_key" and "tunefleet login" in error["message"]
    assert "TUNEFLEET_API_KEY" in error["message"]


def test_wait_exit_codes(cli: Any, service: Service) -> None:
    job_id = queued_job(service)
    timeout = cli("jobs", "wait", job_id, "--timeout", "0.2", "--json", code=4)
    assert json.loads(timeout.stderr)["error"]["code"] == "wait_timeout"
    cli("jobs", "cancel", job_id)
    assert js(cli("jobs", "wait", job_id, "--json", code=3))["status"] == "cancelled"


def test_login_and_config(cli: Any, service: Service, isolated_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNEFLEET_BASE_URL")
    monkeypatch.delenv("TUNEFLEET_API_KEY")
    denied = cli("login", "--base-url", service.base_url, "--api-key", "tf_badbadba_" + "z" * 32, "--json", code=1)
    assert json.loads(denied.stderr)["error"]["code"] == "invalid_api_key"
    assert not isolated_config.exists()
    saved = js(cli("login", "--base-url", service.base_url + "/v1/", "--api-key", service.key, "--json"))
    assert saved["base_url"] == service.base_url and Path(saved["config"]) == isolated_config
    shown = js(cli("config", "--json"))
    assert shown["base_url"] == service.base_url and shown["api_key"].endswith("...")
    assert service.key not in cli("config").stdout
    assert js(cli("jobs", "list", "--json"))["data"] == []  # works from the saved file alone


def _has_route(app: Any, path: str) -> bool:
    # FastAPI >= 0.165 wraps included routers (app.routes holds no paths): ask OpenAPI.
    return path in app.openapi()["paths"]


def test_pools_and_estimate(app: Any, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`pools` and `estimate` print what the service answers (routes of the scheduler issue)."""
    import httpx

    if not (_has_route(app, "/v1/node_pools") and _has_route(app, "/v1/fine_tuning/estimate")):
        pytest.skip("GET /v1/node_pools or POST /v1/fine_tuning/estimate is not served by this build")
    cli, service = request.getfixturevalue("cli"), request.getfixturevalue("service")
    headers = {"Authorization": f"Bearer {service.key}"}
    raw_pools = httpx.get(f"{service.base_url}/v1/node_pools", headers=headers).json()
    pools = js(cli("pools", "--json"))["data"]
    assert [p["name"] for p in pools] == [p["name"] for p in raw_pools["data"]] and pools
    assert pools[0]["name"] in cli("pools").stdout

    data = tmp_path / "train.jsonl"
    data.write_bytes(chat_jsonl(4))
    fid = js(cli("files", "upload", str(data), "--json"))["id"]
    body = {"model": DEMO_MODEL, "training_file": fid, "adapter": {"r": 4}}
    direct = httpx.post(f"{service.base_url}/v1/fine_tuning/estimate", json=body, headers=headers)
    assert direct.status_code == 200, direct.text
    estimate = js(cli("estimate", "-m", DEMO_MODEL, "-t", fid, "--r", "4", "--json"))
    assert set(estimate) == set(direct.json())
    human = cli("estimate", "-m", DEMO_MODEL, "-t", fid, "--r", "4").stdout
    assert "iB" in human and "{" not in human and "breakdown" in human
    chosen = estimate["chosen"]
    if chosen and chosen.get("memory_per_gpu_bytes"):
        assert fmt_bytes(chosen["memory_per_gpu_bytes"]) in human
        assert str(chosen["memory_per_gpu_bytes"]) not in human  # raw bytes
    if chosen and chosen.get("eta_s"):
        assert fmt_seconds(chosen["eta_s"]) in human
    bad = cli("estimate", "-m", "nope", "-t", fid, "--json", code=1)
    assert json.loads(bad.stderr)["error"]["param"] == "model"


def test_webhooks_commands(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from control.settings import get_settings

    monkeypatch.setenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE", "true")
    get_settings.cache_clear()
    try:
        created = js(cli("webhooks", "create", "http://127.0.0.1:9/hook", "--event", "fine_tuning.job.failed",
                         "--json"))
        assert created["secret"].startswith("whsec_") and created["events"] == ["fine_tuning.job.failed"]
        human = cli("webhooks", "create", "http://127.0.0.1:9/other")
        assert "whsec_" in human.stdout and "not shown again" in human.stdout
        listed = js(cli("webhooks", "list", "--json"))["data"]
        assert created["id"] in [e["id"] for e in listed] and len(listed) == 2
        rotated = js(cli("webhooks", "rotate-secret", created["id"], "--grace-period-s", "10", "--json"))
        assert rotated["secret"] != created["secret"]
        assert js(cli("webhooks", "deliveries", created["id"], "--json"))["data"] == []
        assert js(cli("webhooks", "delete", created["id"], "--json"))["deleted"] is True
        gone = cli("webhooks", "deliveries", created["id"], "--json", code=1)
        assert json.loads(gone.stderr)["error"]["code"] == "not_found"
    finally:
        monkeypatch.delenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE")
        get_settings.cache_clear()
    refused = cli("webhooks", "create", "http://127.0.0.1:9/hook", "--json", code=1)
    assert json.loads(refused.stderr)["error"]["code"] == "webhook_url_not_public"


def test_create_with_watch_follows_the_job(cli: Any, service: Service, tmp_path: Path) -> None:
    """`jobs create --watch --json` streams the job as JSON lines until it ends."""
    import threading
    import time

    from tunefleet import Tunefleet

    data = tmp_path / "train.jsonl"
    data.write_bytes(chat_jsonl(4))
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        fid = client.files.upload(data, wait=True).id

    def finish_when_created() -> None:
        with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
            for _ in range(200):
                jobs = client.jobs.list().data
                if jobs:
                    driver = JobDriver(service, jobs[0].id)
                    driver.start()
                    driver.report(driver.metric(1, 1, 0.5))
                    driver.finish("succeeded")
                    return
                time.sleep(0.05)

    helper = threading.Thread(target=finish_when_created)
    helper.start()
    result = cli("jobs", "create", "-m", DEMO_MODEL, "-t", fid, "--watch", "--json")
    helper.join()
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["event"] == "job" and lines[-1]["event"] == "job"
    assert lines[-1]["data"]["status"] == "succeeded"
    assert any(m["event"] == "metric" and m["data"]["train_loss"] == 0.5 for m in lines)


def test_watch_json_lines_follow_a_job_to_its_failure(cli: Any, service: Service) -> None:
    """Standalone `jobs watch --json`: one JSON message per line, exit 3 when the job fails."""
    import threading

    job_id = queued_job(service)
    driver = JobDriver(service, job_id)
    driver.start()
    driver.report(driver.metric(1, 4, 2.25))

    def fail_later() -> None:
        driver.report(driver.metric(2, 4, 1.75),
                      {"type": "event", "level": "error", "message": "loss is NaN at step 3", "data": {}})
        driver.finish("failed")

    helper = threading.Timer(0.5, fail_later)  # the watcher is attached by then
    helper.start()
    result = cli("jobs", "watch", job_id, "--json", "--poll-interval", "0.1", code=3)
    helper.join()
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["event"] == "job" and lines[0]["data"]["id"] == job_id
    assert [m["data"]["train_loss"] for m in lines if m["event"] == "metric"] == [2.25, 1.75]
    assert any(m["event"] == "event" and m["data"]["message"] == "loss is NaN at step 3" for m in lines)
    assert lines[-1]["event"] == "job" and lines[-1]["data"]["status"] == "failed"
    # A job that has ended already: the final state at once, same exit code.
    again = [json.loads(line) for line in cli("jobs", "watch", job_id, "--json", code=3).stdout.splitlines()]
    assert again[-1]["data"]["status"] == "failed"


def test_ids_stay_whole_in_80_columns(cli: Any, service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id folded over two lines cannot be copied: id columns never wrap, others do."""
    job_id = queued_job(service)
    terminal_width(monkeypatch, 80)
    out = cli("jobs", "list").stdout
    assert any(job_id in line for line in out.splitlines()), out
    assert max(len(line) for line in out.splitlines()) <= 80
    file_id = js(cli("jobs", "get", job_id, "--json"))["training_file"]
    assert any(file_id in line for line in cli("files", "list").stdout.splitlines())


def test_estimate_fields_read_as_sizes_and_times() -> None:
    from tunefleet.cli.render import fmt_field

    assert fmt_field("memory_per_gpu_bytes", 20 * 2**30) == "20.0 GiB"
    assert fmt_field("breakdown", {"weights": 2**30, "lora": 3 * 2**20}, unit="bytes") == (
        "weights=1.0 GiB\nlora=3.0 MiB")
    assert [fmt_seconds(s) for s in (45, 200, 7530, 93600)] == ["45s", "3m 20s", "2h 05m", "1d 2h"]
    assert fmt_field("eta_s", 7530) == "2h 05m" and fmt_field("tokens_per_s", 142900.5) == "142,900"
    assert fmt_field("model", {"id": "m", "params": 135_000_000}) == "id=m\nparams=135.0M"


def test_metrics_show_dpo_rewards(cli: Any, service: Service) -> None:
    job_id = queued_job(service)
    driver = JobDriver(service, job_id)
    driver.start()
    driver.report(driver.metric(1, 2, 0.69))
    plain = cli("jobs", "metrics", job_id).stdout  # a supervised run's rows: no reward columns
    assert "0.69" in plain and "reward" not in plain
    driver.report({**driver.metric(2, 2, 0.41), "rewards/accuracy": 0.875, "rewards/margin": 1.25,
                   "rewards/chosen": 0.5, "rewards/rejected": -0.75})
    rows = js(cli("jobs", "metrics", job_id, "--json"))["data"]
    assert rows[1]["rewards/accuracy"] == 0.875 and rows[0]["rewards/accuracy"] is None
    human = cli("jobs", "metrics", job_id).stdout
    assert "reward acc" in human and "reward margin" in human and "valid reward" not in human
    (line,) = [line for line in human.splitlines() if "0.41" in line]
    assert "0.875" in line and "1.25" in line and "-0.75" in line
