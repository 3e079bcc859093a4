"""Hostile training files get a per-line answer, never a crashed validation.

The probe: a JSONL line nested 50,000 deep raised RecursionError in validation and the
file stayed ``uploaded`` forever; a non-UTF-8 line was reported without its line number.
"""

from __future__ import annotations

from tests.api.conftest import chat_lines


def test_a_deeply_nested_line_is_invalid_json_with_its_line_number(client, tenant_key) -> None:
    headers = tenant_key().headers
    body = chat_lines(2) + b"[" * 50_000 + b"]" * 50_000 + b"\n" + chat_lines(1)
    uploaded = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                           files={"file": ("deep.jsonl", body, "application/jsonl")})
    assert uploaded.status_code == 200, uploaded.text
    file = client.get(f"/v1/files/{uploaded.json()['id']}", headers=headers).json()
    assert file["status"] == "error", file
    assert file["status_details"].startswith("1 problem(s); first: line 3: invalid_json"), file


def test_a_non_utf8_line_is_reported_with_its_line_number(client, tenant_key) -> None:
    body = chat_lines(3) + b'{"messages": "caf\xe9"}\n' + chat_lines(1)
    response = client.post("/v1/files", headers=tenant_key().headers, data={"purpose": "fine-tune"},
                           files={"file": ("latin1.jsonl", body, "application/jsonl")})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "not_utf8" and "line 4" in error["message"], error
