"""Any checkpoint's adapter can be downloaded, with checksums, by its job's tenant only."""

from __future__ import annotations

import hashlib
import shutil

from tests.api.conftest import start_running

JOBS = "/v1/fine_tuning/jobs"
ADAPTER = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x00weights",
           "README.md": b"---\nlibrary_name: peft\n---\n"}


def test_checkpoint_adapter_listing_download_and_isolation(client, tenant_key, make_job, db_session, settings):
    owner, other = tenant_key(), tenant_key()
    job_id = make_job(owner.headers)["id"]
    _row, token = start_running(db_session, job_id)
    step_dir = settings.job_dir(job_id) / "checkpoints" / "step-2"
    for name, data in ADAPTER.items():
        (step_dir / "adapter").mkdir(parents=True, exist_ok=True)
        (step_dir / "adapter" / name).write_bytes(data)
    (step_dir / "optimizer.pt").write_bytes(b"not part of the adapter")
    reported = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                           json={"seq": 0, "items": [{"type": "checkpoint", "step": 2, "location": str(step_dir),
                                                      "metrics": {"train_loss": 0.5}}]})
    assert reported.status_code == 200, reported.text
    (checkpoint,) = client.get(f"{JOBS}/{job_id}/checkpoints", headers=owner.headers).json()["data"]
    base = f"{JOBS}/{job_id}/checkpoints/{checkpoint['id']}/artifacts"

    listing = client.get(base, headers=owner.headers)
    assert listing.status_code == 200, listing.text
    assert {(a["name"], a["bytes"], a["sha256"]) for a in listing.json()["data"]} == {
        (name, len(data), hashlib.sha256(data).hexdigest()) for name, data in ADAPTER.items()}
    got = client.get(f"{base}/adapter_model.safetensors", headers=owner.headers)
    assert got.status_code == 200 and got.content == b"\x00weights"
    assert got.headers["x-checksum-sha256"] == hashlib.sha256(b"\x00weights").hexdigest()

    for path in (base, f"{base}/adapter_model.safetensors"):  # another tenant: as if it did not exist
        response = client.get(path, headers=other.headers)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    for name in ("..%2Foptimizer.pt", "nope.bin"):
        response = client.get(f"{base}/{name}", headers=owner.headers)
        assert response.status_code in (400, 404) and b"not part" not in response.content
    unknown = client.get(f"{JOBS}/{job_id}/checkpoints/ftckpt-nope/artifacts", headers=owner.headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "checkpoint_not_found"

    shutil.rmtree(step_dir)  # pruned by keep_last: the row stays, the files are gone
    pruned = client.get(base, headers=owner.headers)
    assert pruned.status_code == 404 and pruned.json()["error"]["code"] == "checkpoint_not_stored"
