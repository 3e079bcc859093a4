"""Artifact stores: local and S3 (against a real moto_server), and S3 downloads by redirect."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from control.artifacts import LocalArtifactStore, S3ArtifactStore, safe_key, store_for
from control.errors import APIError
from tests.conftest import free_port


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):
    binary = shutil.which("moto_server")
    if binary is None:
        pytest.fail("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(url, timeout=0.5)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="tf-artifacts")
    yield url
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("name", ["", "/abs", "a/../b", "..", "a//b", "a\\b", "a/./b", "x\x00y"])
def test_safe_key_refuses(name: str) -> None:
    with pytest.raises(APIError) as caught:
        safe_key(name)
    assert caught.value.code == "invalid_artifact_path"


def test_local_store_roundtrip_and_symlink_escape(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "root")
    store.put_bytes("a/b.txt", b"hello")
    assert store.read_bytes("a/b.txt") == b"hello" and store.size("a/b.txt") == 5
    assert b"".join(store.iter_bytes("a/b.txt", chunk_size=2)) == b"hello"
    assert store.list() == ["a/b.txt"] and store.presigned_url("a/b.txt") is None
    (tmp_path / "outside.txt").write_text("secret")
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(APIError):
        store.read_bytes("link")
    # A sibling whose name merely starts with the root's name is outside too.
    (tmp_path / "root-other").mkdir()
    (tmp_path / "root-other" / "x.txt").write_text("secret")
    (tmp_path / "root" / "sibling").symlink_to(tmp_path / "root-other")
    with pytest.raises(APIError):
        store.read_bytes("sibling/x.txt")
    assert store.location("a") == str(tmp_path.resolve() / "root" / "a")
    store.delete("a/b.txt")
    assert not store.exists("a/b.txt")


def test_local_store_resolves_links_at_any_depth(tmp_path: Path) -> None:
    """Only keys with a symlink below the root are resolved; a link at any depth that
    leads out is refused, one that stays inside is followed, a key not written yet is the
    plain path under the root."""
    store = LocalArtifactStore(tmp_path / "root")
    root = tmp_path.resolve() / "root"
    store.put_bytes("jobs/j1/out.txt", b"ok")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "s.txt").write_text("secret")
    (root / "jobs" / "j1" / "up").symlink_to("../../..")  # relative, three levels up
    (root / "jobs" / "deep").symlink_to(tmp_path / "outside")
    (root / "alias").symlink_to(root / "jobs" / "j1")
    for key in ("jobs/j1/up/outside/s.txt", "jobs/deep/s.txt", "jobs/deep"):
        with pytest.raises(APIError) as caught:
            store.location(key)
        assert caught.value.code == "invalid_artifact_path", key
    assert store.read_bytes("alias/out.txt") == b"ok"
    assert store.location("alias/out.txt") == str(root / "jobs" / "j1" / "out.txt")
    assert store.location("jobs/j2/checkpoints") == str(root / "jobs" / "j2" / "checkpoints")
    assert store.location("jobs/j1/out.txt/below") == str(root / "jobs" / "j1" / "out.txt" / "below")


def test_s3_store_roundtrip(s3_endpoint: str, tmp_path: Path) -> None:
    store = store_for("s3://tf-artifacts/jobs/j1", s3_endpoint_url=s3_endpoint)
    assert isinstance(store, S3ArtifactStore)
    source = tmp_path / "w.bin"
    payload = os.urandom(3 * 1024 * 1024 + 7)
    source.write_bytes(payload)
    store.put_file("adapter/adapter_model.safetensors", source)
    store.put_bytes("manifest.json", b"{}")
    assert store.list() == ["adapter/adapter_model.safetensors", "manifest.json"]
    assert store.size("adapter/adapter_model.safetensors") == len(payload)
    assert b"".join(store.iter_bytes("adapter/adapter_model.safetensors")) == payload
    assert store.location("manifest.json") == "s3://tf-artifacts/jobs/j1/manifest.json"
    url = store.presigned_url("manifest.json")
    assert httpx.get(url).content == b"{}"
    store.delete("manifest.json")
    assert not store.exists("manifest.json")
    with pytest.raises(APIError):
        store.put_bytes("../escape", b"x")


def test_s3_artifact_download_redirects(client, tenant_key, make_job, db_session, s3_endpoint,
                                        app) -> None:
    from tests.api.conftest import start_running

    app.state.settings = app.state.settings.model_copy(
        update={"s3_endpoint_url": s3_endpoint, "artifact_url": "s3://tf-artifacts"})
    tenant = tenant_key()
    job = make_job(tenant.headers)
    _row, token = start_running(db_session, job["id"])
    location = f"s3://tf-artifacts/{job['id']}/output"
    data = b"adapter-bytes"
    store_for(location, s3_endpoint_url=s3_endpoint).put_bytes("adapter/adapter_model.safetensors",
                                                               data)
    client.post(f"/internal/v1/jobs/{job['id']}/reports",
                headers={"Authorization": f"Bearer {token}"},
                json={"seq": 0, "items": [{"type": "artifacts", "location": location, "files": [
                    {"name": "adapter/adapter_model.safetensors", "bytes": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}]}]})
    response = client.get(
        f"/v1/fine_tuning/jobs/{job['id']}/artifacts/adapter/adapter_model.safetensors",
        headers=tenant.headers, follow_redirects=False)
    assert response.status_code == 307
    assert httpx.get(response.headers["location"]).content == data
