"""Dashboard pages carry browser hardening headers, and logout ends the session.

The probe: pages had no Content-Security-Policy and no X-Content-Type-Options; after
logout, a copy of the session cookie still worked on /v1/files.
"""

from __future__ import annotations


def test_pages_and_assets_carry_csp_and_nosniff(client) -> None:
    from api.ui.headers import CONTENT_SECURITY_POLICY

    for path in ("/ui/login", "/ui/static/app.js", "/ui/jobs-that-do-not-exist"):
        response = client.get(path, follow_redirects=False)
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert "'unsafe-inline'" not in response.headers["content-security-policy"].split("script-src")[1].split(";")[0]
    assert "content-security-policy" not in client.get("/healthz").headers


def test_no_template_has_inline_script_handlers() -> None:
    """script-src 'self' blocks inline handlers; a page relying on one would break."""
    import re
    from pathlib import Path

    import api.ui

    templates = Path(api.ui.__file__).parent / "templates"
    for page in templates.glob("*.html"):
        text = page.read_text()
        assert not re.search(r"\son[a-z]+=", text), page.name
        assert not re.search(r"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>", text), page.name


def _sign_in(client, key: str) -> str:
    """Log in through the real form; returns the page's CSRF token."""
    import re

    form = client.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    answer = client.post("/ui/login", data={"api_key": key, "csrf_token": token, "next": "/ui/"},
                         follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get("/ui/")
    return re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text).group(1)


def test_logout_ends_the_session_on_the_server(client, tenant_key) -> None:
    """The probe: after logout, a copy of the session cookie still listed /v1/files."""
    from api.ui.session import SESSION_COOKIE

    csrf = _sign_in(client, tenant_key().key)
    copied = client.cookies.get(SESSION_COOKIE)
    assert client.get("/v1/files").status_code == 200
    assert client.post("/ui/logout", data={"csrf_token": csrf}, follow_redirects=False).status_code == 303
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, copied)
    assert client.get("/v1/files").status_code == 401
    assert client.get("/ui/", follow_redirects=False).headers["location"].startswith("/ui/login")
    # Signing in again gives a new session that works.
    client.cookies.clear()
    _sign_in(client, tenant_key().key)
    assert client.get("/v1/files").status_code == 200
