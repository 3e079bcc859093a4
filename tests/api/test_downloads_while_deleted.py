"""A download whose object is deleted while it is answered: whole or 404, never a cut body.

The probe: ``GET /v1/files/{id}/content`` raced with ``DELETE /v1/files/{id}`` answered 200
with the file's ``Content-Length`` and then ended the body early (``FileNotFoundError``
inside the stream). A download now opens its object before it answers: gone by then, a
404; deleted after, the open object is sent whole (a local file stays readable through its
handle; an S3 GET keeps streaming the object it started).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient

from control.artifacts import S3ArtifactStore, store_for
from tests.api.conftest import start_running
from tests.api.test_artifact_store import s3_endpoint  # noqa: F401 (the moto_server fixture)

DATA = b'{"messages": []}\n' * 40_000  # 680 KB: more than one read of the stream


class DeleteOnAnswer:
    """ASGI wrapper: runs ``delete`` the moment the app starts answering ``path`` (the
    status line and headers are decided; the body is not sent yet)."""

    def __init__(self, app: Any, path: str, delete: Callable[[], None]) -> None:
        self.app, self.path, self.delete = app, path, delete

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start" and scope.get("path") == self.path:
                self.delete()
            await send(message)

        await self.app(scope, receive, sending)


@contextmanager
def racing_client(app: Any, path: str, delete: Callable[[], None]) -> Iterator[TestClient]:
    with TestClient(DeleteOnAnswer(app, path, delete), raise_server_exceptions=False) as client:
        yield client


def _uploaded(client: TestClient, upload: Any, headers: dict[str, str]) -> tuple[str, str]:
    created = upload(headers, DATA)
    assert created.status_code == 200, created.text
    from control.db.models import File
    from control.db.session import session_scope

    with session_scope(client.app.state.settings.resolved_database_url) as session:
        return created.json()["id"], session.get(File, created.json()["id"]).location


def _use_s3_file_store(app: Any, endpoint: str, key: str) -> None:
    """The files now live in a bucket: the uploaded object is copied there."""
    s3 = S3ArtifactStore("tf-files", endpoint_url=endpoint)
    s3._client.create_bucket(Bucket="tf-files")
    s3.put_bytes(key, app.state.file_store.read_bytes(key))
    app.state.file_store = s3


def test_file_content_deleted_while_answered_is_sent_whole(app, client, tenant_key, upload) -> None:
    headers = tenant_key().headers
    file_id, key = _uploaded(client, upload, headers)
    store = app.state.file_store
    with racing_client(app, f"/v1/files/{file_id}/content", lambda: store.delete(key)) as racing:
        response = racing.get(f"/v1/files/{file_id}/content", headers=headers)
    assert not store.exists(key)
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len(response.content) == len(DATA)


def test_file_content_already_gone_is_a_404(app, client, tenant_key, upload) -> None:
    headers = tenant_key().headers
    file_id, key = _uploaded(client, upload, headers)
    app.state.file_store.delete(key)
    response = client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "not_found"


def test_file_content_in_s3_deleted_while_answered_or_before(app, client, tenant_key, upload,
                                                           s3_endpoint) -> None:  # noqa: F811
    headers = tenant_key().headers
    file_id, key = _uploaded(client, upload, headers)
    _use_s3_file_store(app, s3_endpoint, key)
    store = app.state.file_store
    with racing_client(app, f"/v1/files/{file_id}/content", lambda: store.delete(key)) as racing:
        response = racing.get(f"/v1/files/{file_id}/content", headers=headers)
    assert not store.exists(key)
    assert response.status_code == 200 and response.content == DATA
    gone = client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "not_found")


def _job_with_outputs(client: TestClient, app: Any, db_session: Any, make_job: Any,
                      headers: dict[str, str]) -> tuple[str, str, str]:
    """A running job that reported an output file and a checkpoint: (job id, output dir,
    checkpoint dir), both in the local artifact store."""
    job_id = make_job(headers)["id"]
    _row, token = start_running(db_session, job_id)
    root = app.state.settings.resolved_artifact_url
    output, checkpoint = f"{root}/{job_id}/output", f"{root}/{job_id}/checkpoints/step-1"
    store_for(output).put_bytes("adapter/adapter_model.safetensors", DATA)
    store_for(checkpoint).put_bytes("adapter/adapter_model.safetensors", DATA)
    reported = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                           json={"seq": 0, "items": [
                               {"type": "checkpoint", "step": 1, "location": checkpoint, "metrics": {}},
                               {"type": "artifacts", "location": output, "files": [
                                   {"name": "adapter/adapter_model.safetensors", "bytes": len(DATA),
                                    "sha256": hashlib.sha256(DATA).hexdigest()}]}]})
    assert reported.status_code == 200, reported.text
    return job_id, output, checkpoint


def test_job_artifact_and_checkpoint_file_deleted_while_answered_are_sent_whole(
        app, client, tenant_key, make_job, db_session) -> None:
    headers = tenant_key().headers
    job_id, output, checkpoint = _job_with_outputs(client, app, db_session, make_job, headers)
    (ckpt,) = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=headers).json()["data"]
    name = "adapter/adapter_model.safetensors"
    downloads = {
        f"/v1/fine_tuning/jobs/{job_id}/artifacts/{name}": lambda: store_for(output).delete(name),
        f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/artifacts/adapter_model.safetensors":
            lambda: store_for(checkpoint).delete(name),
    }
    for path, delete in downloads.items():
        with racing_client(app, path, delete) as racing:
            response = racing.get(path, headers=headers)
        assert response.status_code == 200, path
        assert int(response.headers["content-length"]) == len(response.content) == len(DATA), path
        assert response.headers["x-checksum-sha256"] == hashlib.sha256(DATA).hexdigest(), path
