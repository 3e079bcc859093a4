"""Trainer reports (dedup, tokens) and what they feed: metrics, checkpoints, artifacts, logs, SSE."""

from __future__ import annotations

import hashlib
import json

import pytest

from api.jobs.commands import issue_job_token
from control.db.models import Job
from control.jobs.lifecycle import transition
from tests.api.conftest import start_running

JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def running(client, tenant_key, make_job, db_session, settings):
    """A running job of a fresh tenant, its token and a helper that posts report batches."""
    tenant = tenant_key()
    job = make_job(tenant.headers)
    row, token = start_running(db_session, job["id"])

    def post(seq: int, *items: dict, auth: str | None = None):
        return client.post(f"/internal/v1/jobs/{job['id']}/reports",
                           json={"seq": seq, "items": list(items)},
                           headers={"Authorization": f"Bearer {auth or token}"})

    return {"job": job, "row": row, "token": token, "post": post, "headers": tenant.headers}


def metric(step: int, loss: float, **extra) -> dict:
    return {"type": "metric", "step": step, "total_steps": 4, "train_loss": loss,
            "tokens_seen": 100 * step, "learning_rate": 1e-4, **extra}


def test_same_seq_is_applied_once(client, running) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    batch = (metric(1, 2.5), {"type": "event", "level": "info", "message": "step 1/4"})
    first = post(0, *batch)
    assert first.json() == {"acked_seq": 0, "duplicate": False}
    again = post(0, *batch)
    assert again.status_code == 200 and again.json() == {"acked_seq": 0, "duplicate": True}
    post(1, metric(2, 2.25))
    metrics = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()
    assert [(m["step"], m["train_loss"]) for m in metrics["data"]] == [(1, 2.5), (2, 2.25)]
    events = client.get(f"{JOBS}/{job_id}/events?limit=100", headers=headers).json()["data"]
    assert [e["message"] for e in events].count("step 1/4") == 1
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert (job["trained_tokens"], job["current_step"], job["total_steps"]) == (200, 2, 4)
    assert job["estimated_finish"] is not None


def test_metrics_cursor_and_restart_overwrite(client, running) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    post(0, *(metric(s, 3.0 - 0.1 * s) for s in range(1, 4)))
    post(1, metric(3, 2.0))  # restarted from a checkpoint: step 3 again, newest wins
    page = client.get(f"{JOBS}/{job_id}/metrics?limit=2", headers=headers).json()
    assert [m["step"] for m in page["data"]] == [1, 2] and page["has_more"] is True
    rest = client.get(f"{JOBS}/{job_id}/metrics?after={page['last_step']}", headers=headers).json()
    assert [(m["step"], m["train_loss"]) for m in rest["data"]] == [(3, 2.0)]


def test_bad_reports(client, running) -> None:
    post = running["post"]
    assert post(0, {"type": "metric"}).status_code == 400
    assert post(-1).status_code == 400
    assert post(0, {"type": "telepathy"}).status_code == 400
    nan = client.post(f"/internal/v1/jobs/{running['job']['id']}/reports",
                      content=b'{"seq": 0, "items": [{"type": "metric", "step": 1, "train_loss": NaN}]}',
                      headers={"Authorization": f"Bearer {running['token']}",
                               "Content-Type": "application/json"})
    assert nan.status_code == 200  # stored as null: JSON answers never carry NaN
    metrics = client.get(f"{JOBS}/{running['job']['id']}/metrics", headers=running["headers"])
    assert metrics.json()["data"][0]["train_loss"] is None


def test_dpo_reward_metrics_are_stored_and_shown(client, running, settings) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    rewards = {"rewards/chosen": 0.25, "rewards/rejected": -0.5, "rewards/accuracy": 0.75,
               "rewards/margin": 0.75, "valid_rewards/accuracy": 0.625, "valid_rewards/margin": 0.5}
    post(0, metric(1, 0.69, **rewards, **{"rewards/unknown": 1.0}))
    row = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"][0]
    assert {k: row[k] for k in rewards} == rewards
    assert row["valid_rewards/chosen"] is None and "rewards/unknown" not in row
    ck = settings.job_dir(job_id) / "checkpoints" / "step-1"
    post(1, {"type": "checkpoint", "step": 1, "location": str(ck),
             "metrics": {"train_loss": 0.69, "rewards/accuracy": 0.75, "valid_rewards/margin": 0.5}})
    checkpoint = client.get(f"{JOBS}/{job_id}/checkpoints", headers=headers).json()["data"][0]
    assert checkpoint["metrics"] == {"step": 1.0, "train_loss": 0.69, "rewards/accuracy": 0.75,
                                     "valid_rewards/margin": 0.5}


def test_reinforcement_metrics_are_stored_and_shown(client, running, settings) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    rl = {"reward_mean": 0.375, "reward_std": 0.5, "kl": 0.0125, "clip_fraction": 0.0625,
          "completion_length": 7.5, "valid_reward_mean": 0.5}
    post(0, metric(1, 0.01, **rl))
    post(1, metric(2, 0.02, reward_mean=0.5))
    first, second = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"]
    assert {k: first[k] for k in rl} == rl
    assert second["reward_mean"] == 0.5 and second["valid_reward_mean"] is None and second["kl"] is None
    ck = settings.job_dir(job_id) / "checkpoints" / "step-2"
    post(2, {"type": "checkpoint", "step": 2, "location": str(ck),
             "metrics": {"train_loss": 0.02, "reward_mean": 0.5, "valid_reward_mean": 0.5}})
    checkpoint = client.get(f"{JOBS}/{job_id}/checkpoints", headers=headers).json()["data"][0]
    assert checkpoint["metrics"] == {"step": 2.0, "train_loss": 0.02, "reward_mean": 0.5, "valid_reward_mean": 0.5}


def test_a_multi_graders_sub_rewards_and_grader_errors_are_stored_and_shown(client, running) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    sub_rewards = {"exact": 0.25, "has_a": 0.75, "overflowed": None}
    assert post(0, metric(1, 0.01, reward_mean=0.625, sub_rewards=sub_rewards, grader_errors=3)).status_code == 200
    assert post(1, metric(2, 0.02, reward_mean=0.5)).status_code == 200  # a trainer that reports neither
    first, second = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"]
    assert (first["sub_rewards"], first["grader_errors"]) == (sub_rewards, 3)
    assert list(first["sub_rewards"]) == ["exact", "has_a", "overflowed"]  # the grader's order, as reported
    assert (second["sub_rewards"], second["grader_errors"]) == (None, None)
    events = client.get(f"{JOBS}/{job_id}/events?limit=100", headers=headers).json()["data"]
    step1 = next(e for e in events if e["message"].startswith("Step 1/4"))
    assert step1["data"]["sub_rewards"] == sub_rewards and step1["data"]["grader_errors"] == 3


@pytest.mark.parametrize(("fields", "where"), [
    ({"sub_rewards": {f"g{i}": 0.5 for i in range(17)}}, "sub_rewards"),
    ({"sub_rewards": {"x" * 65: 0.5}}, "sub_rewards"),
    ({"sub_rewards": {"": 0.5}}, "sub_rewards"),
    ({"sub_rewards": {"exact": "high"}}, "sub_rewards.exact"),
    ({"sub_rewards": ["exact"]}, "sub_rewards"),
    ({"grader_errors": -1}, "grader_errors"),
])
def test_bad_sub_rewards_or_grader_errors_are_refused(client, running, fields, where) -> None:
    answer = running["post"](0, metric(1, 0.01, **fields))
    assert answer.status_code == 400
    assert where in answer.text, answer.text
    assert client.get(f"{JOBS}/{running['job']['id']}/metrics", headers=running["headers"]).json()["data"] == []


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_sub_reward_that_is_not_finite_is_refused(client, running, value) -> None:
    body = b'{"seq": 0, "items": [{"type": "metric", "step": 1, "sub_rewards": {"exact": %s}}]}' % value
    answer = client.post(f"/internal/v1/jobs/{running['job']['id']}/reports", content=body,
                         headers={"Authorization": f"Bearer {running['token']}", "Content-Type": "application/json"})
    assert answer.status_code == 400
    assert "sub_rewards.exact" in answer.text and "finite" in answer.text, answer.text


def test_rotated_token_stops_working(client, running, db_session) -> None:
    row = db_session.get_one(Job, running["job"]["id"])
    new = issue_job_token(db_session, row)
    db_session.commit()
    assert running["post"](0).status_code == 401
    assert running["post"](0, auth=new).status_code == 200


def test_checkpoints_in_openai_shape(client, running, settings) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    ck = settings.job_dir(job_id) / "checkpoints"
    post(0, {"type": "checkpoint", "step": 2, "location": str(ck / "step-2"),
             "metrics": {"train_loss": 1.5, "valid_loss": 1.7, "token_accuracy": 0.4}})
    post(1, {"type": "checkpoint", "step": 4, "location": str(ck / "step-4"),
             "metrics": {"train_loss": 1.2}})
    page = client.get(f"{JOBS}/{job_id}/checkpoints", headers=headers).json()
    assert [c["step_number"] for c in page["data"]] == [4, 2]
    old = page["data"][1]
    assert old["object"] == "fine_tuning.job.checkpoint" and old["id"].startswith("ftckpt-")
    assert old["fine_tuning_job_id"] == job_id
    assert old["fine_tuned_model_checkpoint"].endswith(":ckpt-step-2")
    assert old["metrics"] == {"step": 2.0, "train_loss": 1.5, "valid_loss": 1.7,
                              "train_mean_token_accuracy": 0.4}
    # pause -> resume continues from the newest checkpoint
    client.post(f"{JOBS}/{job_id}/pause", headers=headers)
    resumed = client.post(f"{JOBS}/{job_id}/resume", headers=headers).json()
    assert resumed["resume_from"] == str(ck / "step-4")


def test_artifacts_listing_download_and_traversal(client, running, settings, db_session) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    out = settings.data_path / "artifacts" / job_id / "output"
    files = {"adapter/adapter_model.safetensors": b"\x00weights", "manifest.json": b"{}"}
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    (settings.data_path / "secret.txt").write_text("not yours")
    post(0, {"type": "artifacts", "location": str(out), "files": [
        {"name": n, "bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()}
        for n, d in files.items()]})
    listing = client.get(f"{JOBS}/{job_id}/artifacts", headers=headers).json()["data"]
    assert {(a["name"], a["bytes"]) for a in listing} == {(n, len(d)) for n, d in files.items()}
    got = client.get(f"{JOBS}/{job_id}/artifacts/adapter/adapter_model.safetensors", headers=headers)
    assert got.status_code == 200 and got.content == b"\x00weights"
    assert got.headers["x-checksum-sha256"] == hashlib.sha256(b"\x00weights").hexdigest()
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert job["fine_tuned_model"] == f"ft:tunefleet-tiny-llama:{job['organization_id']}:{job_id}"

    for name in ("..%2F..%2Fsecret.txt", "adapter%2F..%2F..%2F..%2Fsecret.txt",
                 "%2Fetc%2Fpasswd", "adapter%5C..%5Csecret.txt"):
        response = client.get(f"{JOBS}/{job_id}/artifacts/{name}", headers=headers)
        assert response.status_code in (400, 404), name
        assert response.json()["error"]["code"] in ("invalid_artifact_path", "not_found"), name
        assert b"not yours" not in response.content
    missing = client.get(f"{JOBS}/{job_id}/artifacts/nope.bin", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "artifact_not_found"


def test_logs_tail(client, running, settings) -> None:
    job_id, headers = running["job"]["id"], running["headers"]
    assert client.get(f"{JOBS}/{job_id}/logs", headers=headers).text == ""
    log = settings.job_dir(job_id) / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    text = client.get(f"{JOBS}/{job_id}/logs?tail=3", headers=headers).text
    assert text == "line 497\nline 498\nline 499\n"
    assert len(client.get(f"{JOBS}/{job_id}/logs", headers=headers).text.splitlines()) == 200
    assert client.get(f"{JOBS}/{job_id}/logs?tail=0", headers=headers).status_code == 400


def _sse(text: str) -> list[tuple[str, str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            out.append((fields["id"], fields["event"], json.loads(fields["data"])))
    return out


def test_stream_and_resume_with_last_event_id(client, running, db_session) -> None:
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    post(0, metric(1, 2.0), metric(2, 1.5))
    row = db_session.get_one(Job, job_id)
    db_session.refresh(row)
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    messages = _sse(client.get(f"{JOBS}/{job_id}/stream", headers=headers).text)
    kinds = [kind for _, kind, _ in messages]
    assert kinds[-1] == "end"
    statuses = [data["status"] for _, kind, data in messages if kind == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    assert [d["step"] for _, k, d in messages if k == "metric"] == [1, 2]
    # Resume after the first metric: only what came later.
    first_metric_id = next(i for i, k, _ in messages if k == "metric")
    later = _sse(client.get(f"{JOBS}/{job_id}/stream",
                            headers={**headers, "Last-Event-ID": first_metric_id}).text)
    assert [d["step"] for _, k, d in later if k == "metric"] == [2]
    assert all(k != "status" or d["status"] != "queued" for _, k, d in later)


def test_out_of_range_numbers_are_400(running) -> None:
    assert running["post"](2**63).status_code == 400
    assert running["post"](0, metric(2**40, 1.0)).status_code == 400


def test_artifacts_outside_the_service_storage_are_refused(client, running, tmp_path) -> None:
    for location in ("/etc", str(tmp_path.parent), "s3://someone-elses-bucket/x"):
        response = running["post"](0, {"type": "artifacts", "location": location, "files": [
            {"name": "passwd", "bytes": 1, "sha256": "0" * 64}]})
        assert response.status_code == 400, location
        assert response.json()["error"]["code"] == "invalid_artifact_location"
    listing = client.get(f"{JOBS}/{running['job']['id']}/artifacts", headers=running["headers"])
    assert listing.json()["data"] == []


def test_a_wrong_or_foreign_token_changes_nothing(client, running, make_job, db_session, settings) -> None:
    """A rejected batch of every kind of item leaves both jobs exactly as they were."""
    post, headers, job_id = running["post"], running["headers"], running["job"]["id"]
    other, foreign_token = start_running(db_session, make_job(headers)["id"])
    out = settings.data_path / "artifacts" / job_id / "output"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    items = (
        metric(1, 2.5),
        {"type": "event", "level": "info", "message": "forged event"},
        {"type": "checkpoint", "step": 1, "location": str(settings.job_dir(job_id) / "checkpoints" / "step-1"),
         "metrics": {"train_loss": 2.5}},
        {"type": "artifacts", "location": str(out), "files": [
            {"name": "adapter/adapter_model.safetensors", "bytes": 7,
             "sha256": hashlib.sha256(b"weights").hexdigest()}]},
        {"type": "error", "code": "nan_loss", "message": "forged error"},
    )

    def state(job: str) -> dict:
        return {
            "job": {k: v for k, v in client.get(f"{JOBS}/{job}", headers=headers).json().items()
                    if k != "updated_at"},
            "metrics": client.get(f"{JOBS}/{job}/metrics", headers=headers).json()["data"],
            "events": client.get(f"{JOBS}/{job}/events?limit=100", headers=headers).json()["data"],
            "checkpoints": client.get(f"{JOBS}/{job}/checkpoints", headers=headers).json()["data"],
            "artifacts": client.get(f"{JOBS}/{job}/artifacts", headers=headers).json()["data"],
        }

    before = {job_id: state(job_id), other.id: state(other.id)}
    assert before[job_id]["metrics"] == [] and before[job_id]["checkpoints"] == []
    for token, status in (("tfjob_wrong", 401), (foreign_token, 404)):
        response = post(0, *items, auth=token)
        assert response.status_code == status, response.text
    assert {job_id: state(job_id), other.id: state(other.id)} == before

    # The rejected seq was not recorded either: the real trainer's batch 0 is applied in full.
    assert post(0, *items).json() == {"acked_seq": 0, "duplicate": False}
    after = state(job_id)
    assert [m["step"] for m in after["metrics"]] == [1]
    assert len(after["checkpoints"]) == 1 and len(after["artifacts"]) == 1
    assert after["job"]["error"]["code"] == "nan_loss"
    assert "forged event" in [e["message"] for e in after["events"]]
