"""Request bodies are bounded before authentication, forms and report items too.

The probe: a 60 MiB JSON body without a key was read in full before the 401; 10,000
multipart text fields were parsed; a report event's ``data`` had no size limit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.conftest import chat_lines, start_running

MiB = 1024 * 1024


def _too_large(response) -> bool:
    return response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/fine_tuning/jobs", "/internal/v1/jobs/ftjob-x/reports",
                                  "/v1/webhooks", "/ui/login"])
def test_a_huge_body_without_a_key_is_413_before_the_401(client, path) -> None:
    response = client.post(path, content=b"[" + b"0," * (30 * MiB) + b"0]",
                           headers={"Content-Type": "application/json"})
    assert _too_large(response), response.text[:300]


def test_a_body_without_content_length_is_counted_as_it_arrives(client) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(12):  # chunked: the size is only known by reading
            yield b" " * MiB

    response = client.post("/v1/fine_tuning/jobs", content=chunks(),
                           headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert _too_large(response)


def test_the_upload_route_keeps_its_own_larger_limit(client, tenant_key) -> None:
    """A 9 MiB file passes the general limit and reaches the upload's own checks."""
    body = b"\xff" * (9 * MiB)  # not UTF-8: the upload's own answer proves it was read
    response = client.post("/v1/files", headers=tenant_key().headers, data={"purpose": "fine-tune"},
                           files={"file": ("big.jsonl", body, "application/jsonl")})
    assert response.status_code == 400 and response.json()["error"]["code"] == "not_utf8"


def test_an_upload_with_thousands_of_form_fields_is_refused(client, tenant_key) -> None:
    fields = {f"f{i}": "x" for i in range(10_000)}
    response = client.post("/v1/files", headers=tenant_key().headers, data={"purpose": "fine-tune", **fields},
                           files={"file": ("t.jsonl", chat_lines(), "application/jsonl")})
    assert response.status_code == 400, response.text[:300]
    assert "form parts" in response.json()["error"]["message"]


def test_report_items_are_bounded(client, tenant_key, make_job, db_session) -> None:
    job_id = make_job(tenant_key().headers)["id"]
    _, token = start_running(db_session, job_id)
    response = client.post(f"/internal/v1/jobs/{job_id}/reports",
                           headers={"Authorization": f"Bearer {token}"},
                           json={"seq": 0, "items": [{"type": "event", "message": "m",
                                                      "data": {"blob": "x" * 100_000}}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "items[0].event.data"
    ok = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                     json={"seq": 0, "items": [{"type": "event", "message": "m", "data": {"step": 3}}]})
    assert ok.status_code == 200
