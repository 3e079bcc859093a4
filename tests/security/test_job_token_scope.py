"""A job token reaches only its own job's output and checkpoint directories.

The probe: with job A's token, register the data directory (or another job's output, or
another place in the bucket) as A's outputs, then download the secret key, the database
or job B's spec through ``GET /v1/fine_tuning/jobs/A/artifacts/<name>``.
"""

from __future__ import annotations

import hashlib

import pytest

from control.db.models import Artifact
from control.errors import APIError
from tests.api.conftest import start_running
from tests.conftest import make_settings

JOBS = "/v1/fine_tuning/jobs"


def _files(*names: str) -> list[dict]:
    return [{"name": n, "bytes": 1, "sha256": "0" * 64} for n in names]


@pytest.fixture
def two_jobs(client, tenant_key, make_job, db_session):
    a, b = tenant_key(), tenant_key()
    job_a, job_b = make_job(a.headers), make_job(b.headers)
    _, token_a = start_running(db_session, job_a["id"])
    start_running(db_session, job_b["id"])

    def post(seq: int, *items: dict, path: str | None = None):
        return client.post(path or f"/internal/v1/jobs/{job_a['id']}/reports",
                           json={"seq": seq, "items": list(items)},
                           headers={"Authorization": f"Bearer {token_a}"})

    return {"a": job_a["id"], "b": job_b["id"], "headers": a.headers, "post": post}


def test_outputs_outside_the_jobs_own_output_are_refused(client, two_jobs, settings) -> None:
    a, b, post = two_jobs["a"], two_jobs["b"], two_jobs["post"]
    data = settings.data_path
    (data / "secret_key").write_text("the service secret")
    for location in (str(data), str(data / "artifacts"), str(data / "artifacts" / b / "output"),
                     str(data / "jobs" / b), str(data / "artifacts" / a / "output" / ".." / ".." / b),
                     str(data / "artifacts" / a), f"{data}/artifacts/{a}/output/../../../"):
        response = post(0, {"type": "artifacts", "location": location,
                            "files": _files("secret_key", "tunefleet.db", f"jobs/{b}/spec.json")})
        assert response.status_code == 400, location
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_artifact_location", "items[0].location")
    listing = client.get(f"{JOBS}/{a}/artifacts", headers=two_jobs["headers"]).json()["data"]
    assert listing == []
    got = client.get(f"{JOBS}/{a}/artifacts/secret_key", headers=two_jobs["headers"])
    assert got.status_code == 404 and b"the service secret" not in got.content


def test_the_jobs_own_output_still_registers_and_downloads(client, two_jobs, settings) -> None:
    a, post = two_jobs["a"], two_jobs["post"]
    out = settings.data_path / "artifacts" / a / "output"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    digest = hashlib.sha256(b"weights").hexdigest()
    response = post(0, {"type": "artifacts", "location": str(out), "files": [
        {"name": "adapter/adapter_model.safetensors", "bytes": 7, "sha256": digest}]})
    assert response.status_code == 200, response.text
    got = client.get(f"{JOBS}/{a}/artifacts/adapter/adapter_model.safetensors",
                     headers=two_jobs["headers"])
    assert got.status_code == 200 and got.content == b"weights"


def test_artifact_names_escaping_the_output_are_refused(two_jobs, settings) -> None:
    out = settings.data_path / "artifacts" / two_jobs["a"] / "output"
    for name in ("../../secret_key", "/etc/passwd", "a\x00b"):
        response = two_jobs["post"](0, {"type": "artifacts", "location": str(out),
                                        "files": _files("ok.json", name)})
        assert response.status_code == 400, name
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_artifact_path", "items[0].files[1].name")


def test_checkpoints_outside_the_jobs_checkpoint_dir_are_refused(client, two_jobs, settings) -> None:
    a, b, post = two_jobs["a"], two_jobs["b"], two_jobs["post"]
    for location in ("/etc/shadow", str(settings.data_path), str(settings.job_dir(b) / "checkpoints"),
                     "relative/step-1", "s3://bucket/x/step-1"):
        response = post(0, {"type": "checkpoint", "step": 1, "location": location, "metrics": {}})
        assert response.status_code == 400, location
        assert response.json()["error"]["code"] == "invalid_artifact_location"
    assert client.get(f"{JOBS}/{a}/checkpoints", headers=two_jobs["headers"]).json()["data"] == []
    own = str(settings.job_dir(a) / "checkpoints" / "step-1")
    ok = post(0, {"type": "checkpoint", "step": 1, "location": own, "metrics": {}})
    assert ok.status_code == 200, ok.text


def test_control_characters_in_a_location_are_a_400_not_a_500(two_jobs, settings) -> None:
    own = settings.data_path / "artifacts" / two_jobs["a"] / "output"
    for item in ({"type": "artifacts", "location": f"{own}/\x00x", "files": _files("a")},
                 {"type": "checkpoint", "step": 1, "location": f"{own}\n", "metrics": {}},
                 {"type": "artifacts", "location": "s3://b/\x00", "files": _files("a")}):
        response = two_jobs["post"](0, item)
        assert response.status_code == 400, item
        assert response.json()["error"]["code"] == "invalid_artifact_location"


def test_a_stored_location_outside_the_output_is_not_served(client, two_jobs, settings, db_session) -> None:
    """Rows registered before the rule existed are re-checked on download."""
    (settings.data_path / "secret_key").write_text("the service secret")
    db_session.add(Artifact(job_id=two_jobs["a"], name="secret_key", bytes=18, sha256="0" * 64,
                            location=str(settings.data_path)))
    db_session.commit()
    got = client.get(f"{JOBS}/{two_jobs['a']}/artifacts/secret_key", headers=two_jobs["headers"])
    assert got.status_code == 404 and got.json()["error"]["code"] == "artifact_not_found"
    assert b"the service secret" not in got.content


def test_s3_locations_are_confined_to_the_jobs_prefix(tmp_path) -> None:
    from control.reports.ingest import (
        check_artifact_location,
        check_checkpoint_location,
        job_storage,
    )

    settings = make_settings(tmp_path, artifact_url="s3://tf-artifacts/prefix")
    mine, other = "ftjob-mine", "ftjob-other"
    assert job_storage(mine, settings).outputs == ("s3://tf-artifacts/prefix/ftjob-mine/output",)
    check_artifact_location(f"s3://tf-artifacts/prefix/{mine}/output", mine, settings)
    check_checkpoint_location(f"s3://tf-artifacts/prefix/{mine}/checkpoints/step-4", mine, settings)
    for location in ("s3://tf-artifacts/prefix", f"s3://tf-artifacts/prefix/{other}/output",
                     f"s3://tf-artifacts/prefix/{mine}/output/../../{other}/output",
                     f"s3://tf-artifacts/prefix/{mine}/outputs", "s3://other-bucket/x",
                     f"s3://tf-artifacts/prefix/{mine}/output//x",
                     str(tmp_path / "artifacts" / mine / "output")):
        with pytest.raises(APIError) as caught:
            check_artifact_location(location, mine, settings)
        assert caught.value.code == "invalid_artifact_location", location
    with pytest.raises(APIError):
        check_checkpoint_location(f"s3://tf-artifacts/prefix/{mine}/output/step-1", mine, settings)


@pytest.mark.parametrize(("artifact_url", "in_cluster"),
                         [(None, False), (None, True), ("s3://tf-artifacts/p", False),
                          ("s3://tf-artifacts/p", True)])
def test_the_spec_builders_locations_are_accepted(client, tenant_key, make_job, db_session,
                                                   settings, artifact_url, in_cluster) -> None:
    """What the spec builder hands a trainer (both executors, local dir and S3) passes."""
    from control.db.models import Job
    from control.reports.ingest import check_artifact_location, check_checkpoint_location
    from worker.spec_builder import build_spec

    job = db_session.get_one(Job, make_job(tenant_key().headers)["id"])
    placed = settings.model_copy(update={"artifact_url": artifact_url})
    spec = build_spec(db_session, job, placed, pool_accelerator="cpu",
                      pool_families=("fsdp_qlora", "jax_lora"), gpus=1, token="t",
                      in_cluster=in_cluster)
    check_artifact_location(spec.output_dir, job.id, placed)
    check_checkpoint_location(f"{spec.checkpoint.dir}/step-3", job.id, placed)
