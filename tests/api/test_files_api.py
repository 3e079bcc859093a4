"""/v1/files: upload, validation, list/retrieve/content/delete and every bad upload."""

from __future__ import annotations

import pytest

from tests.api.conftest import BAD_LINES, chat_lines


def test_upload_validate_retrieve_content_delete(client, tenant_key, upload, inline_queue) -> None:
    headers = tenant_key().headers
    data = chat_lines(5)
    response = upload(headers, data)
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["object"] == "file" and created["id"].startswith("file-")
    assert created["bytes"] == len(data) and created["purpose"] == "fine-tune"
    assert created["filename"] == "train.jsonl"
    assert inline_queue.names() == ["tunefleet.validate_file"]

    fetched = client.get(f"/v1/files/{created['id']}", headers=headers).json()
    assert fetched["status"] == "processed"
    assert fetched["validation"]["format"] == "chat"
    assert fetched["validation"]["n_examples"] == 5
    assert fetched["validation"]["errors"] == []

    content = client.get(f"/v1/files/{created['id']}/content", headers=headers)
    assert content.status_code == 200 and content.content == data

    deleted = client.delete(f"/v1/files/{created['id']}", headers=headers)
    assert deleted.json() == {"id": created["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{created['id']}", headers=headers).status_code == 404


def test_invalid_file_reports_lines_and_codes(client, tenant_key, upload) -> None:
    headers = tenant_key().headers
    file_id = upload(headers, BAD_LINES).json()["id"]
    body = client.get(f"/v1/files/{file_id}", headers=headers).json()
    assert body["status"] == "error"
    errors = {(e["line"], e["code"]) for e in body["validation"]["errors"]}
    assert (2, "invalid_json") in errors
    assert (3, "no_assistant_message") in errors
    assert "line 2" in body["status_details"]


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"", 400, "empty_file"),
        (b'{"prompt": "caf\xe9", "completion": "x"}\n', 400, "not_utf8"),
        (b'{"prompt": "ok", "completion": "\xff\xfe"}\n', 400, "not_utf8"),
    ],
    ids=["empty", "latin1", "garbage-bytes"],
)
def test_bad_file_bytes(client, tenant_key, upload, data, status, code) -> None:
    response = upload(tenant_key().headers, data)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["param"] == "file"


def test_bad_upload_requests(client, tenant_key) -> None:
    headers = tenant_key().headers
    no_purpose = client.post("/v1/files", headers=headers, files={"file": ("a.jsonl", b"{}\n")})
    assert no_purpose.status_code == 400 and no_purpose.json()["error"]["param"] == "purpose"
    wrong = client.post("/v1/files", headers=headers, files={"file": ("a.jsonl", b"{}\n")},
                        data={"purpose": "assistants"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
    no_file = client.post("/v1/files", headers=headers, files={"x": (None, b"1")},
                          data={"purpose": "fine-tune"})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    as_json = client.post("/v1/files", headers=headers, json={"purpose": "fine-tune"})
    assert as_json.status_code == 400 and as_json.json()["error"]["code"] == "invalid_request"
    broken = client.post("/v1/files", headers={**headers,
                         "Content-Type": "multipart/form-data; boundary=zzz"}, content=b"garbage")
    assert broken.status_code == 400


def test_too_large_is_413_streaming(settings, tenant_key) -> None:
    """Past the limit -> 413, with and without Content-Length, and nothing is kept."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from tests.conftest import make_settings

    small = make_settings(settings.data_path, database_url=settings.resolved_database_url,
                          max_upload_bytes=1000)
    headers = tenant_key().headers
    with TestClient(create_app(small, queue=None), raise_server_exceptions=False) as client:
        big = chat_lines(60)
        assert len(big) > 1000
        response = client.post("/v1/files", headers=headers, files={"file": ("b.jsonl", big)},
                               data={"purpose": "fine-tune"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "file_too_large"

        # Chunked (no Content-Length): refused while streaming, after ~limit bytes.
        boundary = "tfboundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                f"fine-tune\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"b.jsonl\"\r\n\r\n").encode()
        def body():
            yield head
            for _ in range(200):  # 200 x 512 bytes = 100 KiB, far past the limit
                yield b"x" * 512
            yield f"\r\n--{boundary}--\r\n".encode()

        response = client.post("/v1/files", headers={
            **headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}, content=body())
        assert response.status_code == 413
        assert client.get("/v1/files", headers=headers).json()["data"] == []
    assert list(small.tmp_dir.iterdir()) == []


def test_list_purpose_filter_and_cursor(client, tenant_key, upload) -> None:
    headers = tenant_key().headers
    ids = [upload(headers, chat_lines(2)).json()["id"] for _ in range(3)]
    page = client.get("/v1/files?limit=2", headers=headers).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get(f"/v1/files?limit=2&after={page['data'][-1]['id']}", headers=headers).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert client.get("/v1/files?purpose=batch", headers=headers).json()["data"] == []

    bad = client.get("/v1/files?after=file-nope", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"
    bad = client.get("/v1/files?limit=0", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    bad = client.get("/v1/files?limit=many", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_file_in_use_cannot_be_deleted(client, tenant_key, make_job) -> None:
    headers = tenant_key().headers
    job = make_job(headers)
    response = client.delete(f"/v1/files/{job['training_file']}", headers=headers)
    assert response.status_code == 409 and response.json()["error"]["code"] == "file_in_use"
    client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=headers)
    assert client.delete(f"/v1/files/{job['training_file']}", headers=headers).status_code == 200
