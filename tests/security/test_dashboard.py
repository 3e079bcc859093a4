"""Dashboard pages carry browser hardening headers.

The probe: pages had no Content-Security-Policy and no X-Content-Type-Options.
"""

from __future__ import annotations

from api.ui.headers import CONTENT_SECURITY_POLICY


def test_pages_and_assets_carry_csp_and_nosniff(client) -> None:
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
