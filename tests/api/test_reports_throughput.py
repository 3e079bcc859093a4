"""Each reported step's MFU and the job's mean tokens/s and MFU (``scheduling.throughput``)."""

from __future__ import annotations

import pytest

from tests.api.conftest import start_running

JOBS = "/v1/fine_tuning/jobs"
# As admission stores it: a model of 6e9 FLOPs per token on 2 devices of 1 PFLOP/s each.
BASIS = {"model_flops_per_token": 6e9, "peak_flops": 2 * 1e15}


def _running(client, tenant_key, make_job, db_session, basis: dict | None):
    tenant = tenant_key()
    job = make_job(tenant.headers)
    row, token = start_running(db_session, job["id"])
    if basis is not None:
        row.estimate = {**(row.estimate or {}), "throughput": basis}
        db_session.commit()

    def post(seq: int, *items: dict):
        response = client.post(f"/internal/v1/jobs/{job['id']}/reports", json={"seq": seq, "items": list(items)},
                               headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 200, response.text

    return job["id"], tenant.headers, post


def metric(step: int, tokens_per_s: float | None) -> dict:
    return {"type": "metric", "step": step, "total_steps": 4, "train_loss": 1.0, "tokens_seen": 100 * step,
            "tokens_per_s": tokens_per_s}


def test_each_step_gets_its_mfu_and_the_job_their_means(client, tenant_key, make_job, db_session) -> None:
    job_id, headers, post = _running(client, tenant_key, make_job, db_session, BASIS)
    # 100k tok/s x 6e9 = 6e14 FLOP/s of 2e15: 30 %; 150k tok/s: 45 %.
    post(0, metric(1, 100_000.0), metric(2, 150_000.0), metric(3, None))
    rows = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"]
    assert [(m["step"], m["tokens_per_s"]) for m in rows] == [(1, 100_000.0), (2, 150_000.0), (3, None)]
    assert rows[0]["mfu"] == pytest.approx(0.30) and rows[1]["mfu"] == pytest.approx(0.45)
    assert rows[2]["mfu"] is None  # no throughput reported for the step
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert job["mean_tokens_per_s"] == pytest.approx(125_000.0) and job["mean_mfu"] == pytest.approx(0.375)
    listed = client.get(JOBS, headers=headers).json()["data"][0]
    assert (listed["id"], listed["mean_mfu"]) == (job_id, job["mean_mfu"])

    # A restarted trainer reports step 2 again: its new row replaces the old one in the mean.
    post(1, metric(2, 50_000.0))
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert job["mean_tokens_per_s"] == pytest.approx(75_000.0) and job["mean_mfu"] == pytest.approx(0.225)
    step_2 = client.get(f"{JOBS}/{job_id}/metrics?after=1&limit=1", headers=headers).json()["data"][0]
    assert step_2["mfu"] == pytest.approx(0.15)


def test_a_job_without_a_throughput_basis_has_no_mfu(client, tenant_key, make_job, db_session) -> None:
    """Admitted before admission stored the basis (or never placed by the scheduler):
    tokens/s is still averaged, MFU stays null rather than a made-up 0."""
    job_id, headers, post = _running(client, tenant_key, make_job, db_session, None)
    before = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert before["mean_tokens_per_s"] is None and before["mean_mfu"] is None
    post(0, metric(1, 1000.0), metric(2, 3000.0))
    rows = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"]
    assert [m["mfu"] for m in rows] == [None, None]
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert job["mean_tokens_per_s"] == 2000.0 and job["mean_mfu"] is None
