"""OpenAI's Uploads API: a file sent in parts becomes a File that validates and trains like
one from ``POST /v1/files``; every misuse is a clear error; parts never sit in memory."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import tracemalloc
from typing import Any

import httpx
import pytest

from control.db.models import Upload, UploadPart
from tests.api.conftest import chat_lines
from tests.api.test_artifact_store import s3_endpoint  # noqa: F401 (the moto_server fixture)
from tests.conftest import InlineQueue

MiB = 1024 * 1024


def _create(client, headers: dict[str, str], size: int, **extra: Any) -> dict[str, Any]:
    answer = client.post("/v1/uploads", headers=headers, json={
        "bytes": size, "filename": "train.jsonl", "mime_type": "text/jsonl", "purpose": "fine-tune", **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _part(client, headers: dict[str, str], upload_id: str, data: bytes) -> httpx.Response:
    return client.post(f"/v1/uploads/{upload_id}/parts", headers=headers, files={"data": ("blob", data)})


def _part_id(client, headers: dict[str, str], upload_id: str, data: bytes) -> str:
    answer = _part(client, headers, upload_id, data)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def _complete(client, headers: dict[str, str], upload_id: str, part_ids: list[str], **extra: Any) -> httpx.Response:
    return client.post(f"/v1/uploads/{upload_id}/complete", headers=headers, json={"part_ids": part_ids, **extra})


def _error(answer: httpx.Response) -> tuple[int, str, str | None]:
    error = answer.json()["error"]
    return answer.status_code, error["code"], error["param"]


def test_the_openai_sdk_uploads_a_file_in_parts_that_trains_like_an_upload(sdk, app) -> None:
    oai, _ = sdk
    data = chat_lines(40)
    done = oai.uploads.upload_file_chunked(
        file=data, filename="train.jsonl", bytes=len(data), mime_type="text/jsonl", purpose="fine-tune",
        part_size=len(data) // 3 + 1, md5=hashlib.md5(data).hexdigest())
    assert (done.object, done.status, done.bytes, done.filename) == ("upload", "completed", len(data), "train.jsonl")
    assert done.expires_at == done.created_at + 3600 and done.file is not None
    made = oai.files.retrieve(done.file.id)
    assert (made.status, made.bytes, made.filename, made.purpose) == (
        "processed", len(data), "train.jsonl", "fine-tune")
    assert made.sha256 == hashlib.sha256(data).hexdigest()  # type: ignore[attr-defined]
    assert oai.files.content(made.id).content == data
    assert app.state.file_store.list(f"uploads/{done.id}") == []  # the parts are gone
    job = oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=made.id)
    assert job.status == "queued" and job.training_file == made.id


def test_completion_checks_the_parts_named_their_order_and_their_size(client, tenant_key, settings) -> None:
    headers = tenant_key().headers
    data = chat_lines(6)
    upload = _create(client, headers, len(data))
    first = _part_id(client, headers, upload["id"], data[:100])
    second = _part_id(client, headers, upload["id"], data[100:])
    elsewhere = _create(client, headers, 10)
    foreign = _part_id(client, headers, elsewhere["id"], b"x" * 5)
    md5 = hashlib.md5(data).hexdigest()
    for part_ids, extra, expected in (
        ([first], {}, (400, "invalid_part_ids", "part_ids")),  # a part left out
        ([first, first], {}, (400, "invalid_part_ids", "part_ids[1]")),
        ([first, foreign], {}, (400, "invalid_part_ids", "part_ids[1]")),  # another upload's part
        ([second, first], {"md5": md5}, (400, "md5_mismatch", "md5")),  # the wrong order
    ):
        assert _error(_complete(client, headers, upload["id"], part_ids, **extra)) == expected, part_ids
    done = _complete(client, headers, upload["id"], [first, second], md5=md5)
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "completed" and done.json()["file"]["bytes"] == len(data)
    again = _complete(client, headers, upload["id"], [first, second])
    assert _error(again) == (409, "upload_not_pending", None) and "completed" in again.json()["error"]["message"]
    assert _error(_part(client, headers, upload["id"], b"x"))[:2] == (409, "upload_not_pending")
    assert _error(client.post(f"/v1/uploads/{upload['id']}/cancel", headers=headers))[:2] == (409, "upload_not_pending")

    short = _create(client, headers, 50)
    _part_id(client, headers, short["id"], b"x" * 20)
    assert _error(_part(client, headers, short["id"], b"x" * 40)) == (400, "upload_size_mismatch", "data")
    assert _error(_part(client, headers, short["id"], b"")) == (400, "empty_file", "data")
    listed = _complete(client, headers, short["id"], [_part_id(client, headers, short["id"], b"y" * 10)])
    assert _error(listed) == (400, "invalid_part_ids", "part_ids")

    too_big = client.post("/v1/uploads", headers=headers, json={
        "bytes": settings.max_upload_bytes + 1, "filename": "t.jsonl", "mime_type": "text/jsonl",
        "purpose": "fine-tune"})
    assert _error(too_big) == (413, "file_too_large", "bytes")
    other_purpose = client.post("/v1/uploads", headers=headers, json={
        "bytes": 5, "filename": "t.pdf", "mime_type": "application/pdf", "purpose": "assistants"})
    assert _error(other_purpose) == (400, "invalid_request", "purpose")


def test_a_size_mismatch_at_completion_names_both_sizes(client, tenant_key) -> None:
    headers = tenant_key().headers
    upload = _create(client, headers, 50)
    part = _part_id(client, headers, upload["id"], b"x" * 20)
    answer = _complete(client, headers, upload["id"], [part])
    assert _error(answer) == (400, "upload_size_mismatch", "part_ids")
    assert "20 bytes" in answer.json()["error"]["message"] and "50 bytes" in answer.json()["error"]["message"]


def test_a_character_may_span_two_parts_but_a_file_that_is_not_utf8_is_refused(client, tenant_key) -> None:
    headers = tenant_key().headers
    line = json.dumps({"messages": [{"role": "user", "content": "Un café ?"},
                                    {"role": "assistant", "content": "Oui."}]}, ensure_ascii=False).encode() + b"\n"
    cut = line.index("é".encode()) + 1  # between the two bytes of the é
    upload = _create(client, headers, len(line), expires_after={"anchor": "created_at", "seconds": 7200})
    parts = [_part_id(client, headers, upload["id"], line[:cut]), _part_id(client, headers, upload["id"], line[cut:])]
    done = _complete(client, headers, upload["id"], parts)
    assert done.status_code == 200, done.text
    made = done.json()["file"]
    assert made["status"] == "processed" and made["expires_at"] == made["created_at"] + 7200

    bad = line.replace("é".encode(), b"\xe9")
    upload = _create(client, headers, len(bad))
    answer = _complete(client, headers, upload["id"], [_part_id(client, headers, upload["id"], bad)])
    assert _error(answer) == (400, "not_utf8", "part_ids") and "line 1" in answer.json()["error"]["message"]
    assert _complete(client, headers, upload["id"], []).status_code == 400  # still pending: fixable


def test_uploads_are_their_tenants_only_and_cancelling_deletes_the_parts(client, tenant_key, app) -> None:
    owner, stranger = tenant_key().headers, tenant_key().headers
    upload = _create(client, owner, 10)
    part = _part_id(client, owner, upload["id"], b"x" * 4)
    assert app.state.file_store.list(f"uploads/{upload['id']}") != []
    for answer in (_part(client, stranger, upload["id"], b"x"), _complete(client, stranger, upload["id"], [part]),
                   client.post(f"/v1/uploads/{upload['id']}/cancel", headers=stranger)):
        assert _error(answer) == (404, "not_found", None)
    theirs = _create(client, stranger, 4)
    assert _error(_complete(client, stranger, theirs["id"], [part])) == (400, "invalid_part_ids", "part_ids[0]")

    cancelled = client.post(f"/v1/uploads/{upload['id']}/cancel", headers=owner)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert app.state.file_store.list(f"uploads/{upload['id']}") == []
    assert _error(_part(client, owner, upload["id"], b"x"))[:2] == (409, "upload_not_pending")


def test_an_upload_expires_after_an_hour_and_the_sweep_deletes_its_parts(client, tenant_key, app, db_session,
                                                                          settings, monkeypatch) -> None:
    from worker.tasks import files as tasks

    headers = tenant_key().headers
    upload = _create(client, headers, 10)
    assert upload["expires_at"] == upload["created_at"] + 3600
    part = _part_id(client, headers, upload["id"], b"x" * 4)
    row = db_session.get_one(Upload, upload["id"])
    row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    db_session.commit()

    answer = _part(client, headers, upload["id"], b"x")
    assert _error(answer)[:2] == (409, "upload_not_pending") and "expired" in answer.json()["error"]["message"]
    assert _error(_complete(client, headers, upload["id"], [part]))[:2] == (409, "upload_not_pending")
    monkeypatch.setattr(tasks, "get_settings", lambda: settings)
    assert tasks.expire_uploads_task() == [upload["id"]]
    db_session.expire_all()
    assert db_session.get_one(Upload, upload["id"]).status == "expired"
    assert db_session.get(UploadPart, part) is None
    assert app.state.file_store.list(f"uploads/{upload['id']}") == []
    assert tasks.expire_uploads_task() == []


@pytest.mark.parametrize("backend", ["sqlite"])  # the store is what changes here, not the database
def test_in_s3_the_parts_become_one_object_through_a_multipart_upload(settings, tenant_key, request) -> None:
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from api.main import create_app
    from control.artifacts import file_store
    from control.ids import new_id

    endpoint = request.getfixturevalue("s3_endpoint")
    in_s3 = settings.model_copy(update={"artifact_url": f"s3://tf-artifacts/{new_id('up')}",
                                        "s3_endpoint_url": endpoint})
    line = json.dumps({"messages": [{"role": "user", "content": "Say it long."},
                                    {"role": "assistant", "content": "y" * 2000}]}).encode() + b"\n"
    data = line * (9 * MiB // len(line) + 1)  # over one 8 MiB part of the assembled object
    with TestClient(create_app(in_s3, queue=InlineQueue(in_s3)), raise_server_exceptions=False) as client:
        oai = OpenAI(api_key=tenant_key().key, base_url="http://testserver/v1", http_client=client, max_retries=0)
        done = oai.uploads.upload_file_chunked(file=data, filename="big.jsonl", bytes=len(data),
                                               mime_type="text/jsonl", purpose="fine-tune", part_size=3 * MiB)
        assert done.status == "completed" and done.file is not None
        assert oai.files.retrieve(done.file.id).status == "processed"
    store = file_store(in_s3)
    assert hashlib.sha256(store.read_bytes(f"files/{done.file.id}.jsonl")).digest() == hashlib.sha256(data).digest()
    assert store.list("uploads") == []


def _multipart(size: int, chunk: bytes) -> tuple[str, Any]:
    """A ``data`` part of ``size`` bytes (a multiple of the chunk), produced as it is sent."""
    boundary = "memoryflatboundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="blob"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n").encode()

    async def body():
        yield head
        for _ in range(size // len(chunk)):
            yield chunk
        yield f"\r\n--{boundary}--\r\n".encode()

    return f"multipart/form-data; boundary={boundary}", body()


async def _peak_bytes_of_an_upload(app: Any, headers: dict[str, str], part_size: int) -> int:
    """The most Python memory in use while two parts of ``part_size`` bytes are sent and
    completed, above what was in use before (the body is generated as it is sent)."""
    chunk = (b"0123456789abcdef" * 4096)[:64 * 1024]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        created = await http.post("/v1/uploads", headers=headers, json={
            "bytes": 2 * part_size, "filename": "big.jsonl", "mime_type": "text/jsonl", "purpose": "fine-tune"})
        upload_id = created.json()["id"]
        tracemalloc.reset_peak()
        baseline, _ = tracemalloc.get_traced_memory()
        part_ids = []
        for _ in range(2):
            content_type, body = _multipart(part_size, chunk)
            answer = await http.post(f"/v1/uploads/{upload_id}/parts", content=body,
                                     headers={**headers, "Content-Type": content_type})
            assert answer.status_code == 200, answer.text
            part_ids.append(answer.json()["id"])
        done = await http.post(f"/v1/uploads/{upload_id}/complete", headers=headers, json={"part_ids": part_ids})
        assert done.status_code == 200, done.text
        assert done.json()["file"]["bytes"] == 2 * part_size
        _, peak = tracemalloc.get_traced_memory()
    return peak - baseline


@pytest.mark.parametrize("backend", ["sqlite"])
def test_memory_stays_flat_while_a_large_upload_streams(app, inline_queue, tenant_key) -> None:
    inline_queue.run_validation = False  # the validator is not what this measures
    headers = tenant_key().headers
    tracemalloc.start()
    try:
        small = asyncio.run(_peak_bytes_of_an_upload(app, headers, 2 * MiB))
        large = asyncio.run(_peak_bytes_of_an_upload(app, headers, 16 * MiB))  # each part over the 8 MiB body cap
    finally:
        tracemalloc.stop()
    # 8x the bytes, the same memory: a few chunks in flight, never a part (16 MiB) or the file.
    assert large < 8 * MiB, (small, large)
    assert large < small + MiB, (small, large)
