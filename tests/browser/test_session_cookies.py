"""The dashboard session cookie and its CSRF rules, without a browser or a database.

A two-route app uses the real helpers of ``api.ui.session``: one route starts a session
for a key id, the other answers what ``session_key_id`` resolves (or the CSRF error).
"""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient
from itsdangerous import URLSafeTimedSerializer

from api.errors import install_error_handlers
from api.ui import session as ui_session
from control.settings import get_settings

SECRET = "s" * 48


@pytest.fixture()
def client(monkeypatch: pytest.MonkeyPatch, tmp_path) -> TestClient:
    monkeypatch.setenv("TUNEFLEET_SECRET_KEY", SECRET)
    monkeypatch.setenv("TUNEFLEET_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/login/{key_id}")
    def login(key_id: str, request: Request, response: Response) -> dict[str, str]:
        state = ui_session.start_session(response, request, key_id)
        return {"csrf": state.csrf_token}

    @app.api_route("/whoami", methods=["GET", "POST", "DELETE"])
    def whoami(request: Request) -> dict[str, str | None]:
        return {"key_id": ui_session.session_key_id(request)}

    yield TestClient(app, base_url="http://testserver")
    get_settings.cache_clear()


def _login(client: TestClient, key_id: str = "key-abc") -> str:
    answer = client.post(f"/login/{key_id}")
    assert answer.status_code == 200
    return answer.json()["csrf"]


def test_cookie_is_httponly_strict_and_holds_no_key(client: TestClient) -> None:
    answer = client.post("/login/key-abc")
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{ui_session.SESSION_COOKIE}=")
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Path=/" in cookie
    # The cookie names the key row, never a raw key (tf_… secrets).
    assert "tf_" not in cookie.split(";")[0].split("=", 1)[1]


def test_safe_request_resolves_key_id(client: TestClient) -> None:
    _login(client)
    assert client.get("/whoami").json() == {"key_id": "key-abc"}


def test_no_cookie_resolves_nothing(client: TestClient) -> None:
    assert client.get("/whoami").json() == {"key_id": None}


def test_forged_cookie_is_ignored(client: TestClient) -> None:
    forged = URLSafeTimedSerializer("another-secret" * 4, salt="tunefleet.ui.session.v1").dumps(
        {"kid": "key-admin", "csrf": "x"}
    )
    client.cookies.set(ui_session.SESSION_COOKIE, forged)
    assert client.get("/whoami").json() == {"key_id": None}


def test_tampered_cookie_is_ignored(client: TestClient) -> None:
    _login(client, "key-tenant")
    value = client.cookies.get(ui_session.SESSION_COOKIE)
    # Swap the payload for another key id, keep the signature of the original.
    signature = value.split(".", 1)[1]
    other = URLSafeTimedSerializer(SECRET, salt="tunefleet.ui.session.v1").dumps(
        {"kid": "key-admin", "csrf": "x"}
    )
    client.cookies.clear()
    client.cookies.set(ui_session.SESSION_COOKIE, other.split(".", 1)[0] + "." + signature)
    assert client.get("/whoami").json() == {"key_id": None}
    client.cookies.clear()
    client.cookies.set(ui_session.SESSION_COOKIE, value)
    assert client.get("/whoami").json() == {"key_id": "key-tenant"}


def test_expired_cookie_is_ignored(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    _login(client)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + ui_session.SESSION_MAX_AGE_S + 5)
    assert client.get("/whoami").json() == {"key_id": None}


def test_unsafe_request_needs_the_session_csrf_token(client: TestClient) -> None:
    token = _login(client)
    refused = client.post("/whoami")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_failed"
    wrong = client.post("/whoami", headers={ui_session.CSRF_HEADER: "not-the-token"})
    assert wrong.status_code == 403
    accepted = client.delete("/whoami", headers={ui_session.CSRF_HEADER: token})
    assert accepted.status_code == 200
    assert accepted.json() == {"key_id": "key-abc"}


def test_token_of_another_session_is_refused(client: TestClient) -> None:
    old_token = _login(client, "key-abc")
    _login(client, "key-abc")  # a new login draws a new token
    assert client.post("/whoami", headers={ui_session.CSRF_HEADER: old_token}).status_code == 403


def test_cross_origin_unsafe_request_is_refused_even_with_token(client: TestClient) -> None:
    token = _login(client)
    answer = client.post(
        "/whoami", headers={ui_session.CSRF_HEADER: token, "Origin": "http://evil.example"}
    )
    assert answer.status_code == 403
    same = client.post(
        "/whoami", headers={ui_session.CSRF_HEADER: token, "Origin": "http://testserver"}
    )
    assert same.status_code == 200
