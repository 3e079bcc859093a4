"""Dashboard sessions and CSRF: an API key exchanged once for a signed, HttpOnly cookie.

Login posts an API key; the server checks it like a Bearer key and answers with a cookie
that holds the key's **row id** (``key-…``) and a random CSRF token, signed with the
server's secret key (itsdangerous, timestamped). The key itself never lives in the browser
after the login form: a stolen cookie is useless outside this origin and expires
(``SESSION_MAX_AGE_S``), and because every request re-loads the key row by id, revoking
the key ends its dashboard sessions at once. Encrypting the key into the cookie would
keep neither property.

CSRF: the cookie is ``SameSite=Strict`` and ``HttpOnly``. On top of that, every unsafe
request authenticated by the cookie (a dashboard form post, or a JSON API call made by
the dashboard's JavaScript) must send the session's CSRF token again, in the
``X-CSRF-Token`` header or a ``csrf_token`` form field — a signed double submit: the
token is bound to the signed session, so a cookie planted by a sibling subdomain cannot
forge it. The page receives the token in a ``<meta>`` tag rendered by the server.
Bearer-authenticated API calls carry no ambient credentials and need no token.

``session_api_key(db, request)`` is the one function the JSON API's auth dependency
(``api/deps.py``) and the pages call to accept the cookie in place of a Bearer key.

Logout ends the session on the server too: each cookie carries a random session id, and
logout records it (``api/ui/models.py``) until the cookie would have expired, so a copied
cookie stops working at once.
"""

from __future__ import annotations

import datetime as dt
import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request, Response
from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from sqlalchemy import delete
from sqlalchemy.orm import Session

from api.ui.models import RevokedUiSession
from control.db.base import utcnow
from control.db.models import ApiKey
from control.errors import APIError
from control.settings import Settings, get_settings

SESSION_COOKIE = "tf_session"
LOGIN_CSRF_COOKIE = "tf_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FORM_FIELD = "csrf_token"
SESSION_MAX_AGE_S = 12 * 3600
LOGIN_FORM_MAX_AGE_S = 3600

_SESSION_SALT = "tunefleet.ui.session.v1"
_LOGIN_SALT = "tunefleet.ui.login-csrf.v1"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class CsrfError(APIError):
    """A cookie-authenticated unsafe request without the session's CSRF token (403)."""

    def __init__(self, message: str) -> None:
        super().__init__(403, "csrf_failed", message)


@dataclass(frozen=True)
class UiSession:
    """What the signed session cookie holds."""

    key_id: str
    csrf_token: str
    session_id: str  # what logout revokes (api/ui/models.py)


def _settings(request: Request) -> Settings:
    """The app's settings (``create_app`` puts them on ``app.state``), else the environment's."""
    settings = getattr(request.app.state, "settings", None)
    return settings if settings is not None else get_settings()


def _serializer(request: Request, salt: str) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(_settings(request).secret_key_value(), salt=salt)


def _is_https(request: Request) -> bool:
    if request.url.scheme == "https":
        return True
    # Behind a TLS-terminating ingress the app sees http; trust the configured public URL.
    return _settings(request).public_url.startswith("https://")


def start_session(response: Response, request: Request, key_id: str) -> UiSession:
    """Set the session cookie for the API key row ``key_id`` (after the key was verified).

    A fresh CSRF token is drawn for every login, so tokens never survive a re-login.
    """
    session = UiSession(key_id=key_id, csrf_token=secrets.token_urlsafe(32),
                        session_id=secrets.token_urlsafe(24))
    value = _serializer(request, _SESSION_SALT).dumps(
        {"kid": session.key_id, "csrf": session.csrf_token, "sid": session.session_id})
    response.set_cookie(
        SESSION_COOKIE,
        value,
        max_age=SESSION_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=_is_https(request),
    )
    return session


def end_session(response: Response, db: Session, session: UiSession | None) -> None:
    """Log out: record ``session`` as revoked (every copy of its cookie stops working at
    once) and remove the cookie from this browser. The caller commits."""
    if session is not None:
        now = utcnow()
        db.execute(delete(RevokedUiSession).where(RevokedUiSession.expires_at < now))
        if db.get(RevokedUiSession, session.session_id) is None:
            db.add(RevokedUiSession(session_id=session.session_id,
                                    expires_at=now + dt.timedelta(seconds=SESSION_MAX_AGE_S)))
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")


def read_session(request: Request) -> UiSession | None:
    """The valid, unexpired session of this request, or None (absent, forged or expired)."""
    raw = request.cookies.get(SESSION_COOKIE)
    if not raw:
        return None
    try:
        data = _serializer(request, _SESSION_SALT).loads(raw, max_age=SESSION_MAX_AGE_S)
    except (SignatureExpired, BadSignature):
        return None
    if not isinstance(data, dict):
        return None
    key_id, csrf, sid = data.get("kid"), data.get("csrf"), data.get("sid")
    if not all(isinstance(v, str) and v for v in (key_id, csrf, sid)):
        return None  # also a cookie from before sessions had ids: it cannot be revoked
    return UiSession(key_id=key_id, csrf_token=csrf, session_id=sid)


def tokens_match(expected: str, given: str | None) -> bool:
    """Constant-time comparison of two CSRF tokens."""
    return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


def _same_origin(request: Request) -> bool:
    """False when the browser says the request came from another origin."""
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        # Same-origin fetches may omit Origin on GET; unsafe ones from pages send it.
        # A literal "null" origin (sandboxed frame, file://) is never ours.
        return origin is None
    here = urlsplit(str(request.base_url))
    there = urlsplit(origin)
    return (there.scheme, there.netloc) == (here.scheme, here.netloc)


def check_csrf(request: Request, session: UiSession, form_token: str | None = None) -> None:
    """Raise ``CsrfError`` unless an unsafe cookie request proves it came from our pages.

    Args:
        request: the incoming request.
        session: its session (from ``read_session``).
        form_token: the ``csrf_token`` field of a posted form, if the caller parsed one.
    """
    if request.method in _SAFE_METHODS:
        return
    if not _same_origin(request):
        raise CsrfError("cross-origin request refused: the Origin header is not this site")
    given = request.headers.get(CSRF_HEADER) or form_token
    if not tokens_match(session.csrf_token, given):
        raise CsrfError(
            f"missing or wrong CSRF token: send the dashboard's token in the {CSRF_HEADER} "
            "header (or authenticate with a Bearer key)"
        )


def session_key_id(request: Request) -> str | None:
    """The API key row id in this request's signed session cookie, or None.

    Checks the cookie's signature and age and, for unsafe methods, the CSRF token (raises
    ``CsrfError``, a 403). It does not consult the database: whoever authenticates with
    the cookie calls ``session_api_key``, which also refuses logged-out sessions and
    revoked keys.
    """
    session = read_session(request)
    if session is None:
        return None
    check_csrf(request, session)
    return session.key_id


# ---- login form CSRF (before a session exists) ---------------------------------------


def new_login_token() -> str:
    """A random token for the login form's hidden field (see ``set_login_cookie``)."""
    return secrets.token_urlsafe(24)


def set_login_cookie(response: Response, request: Request, token: str) -> None:
    """Mirror the login form's token in a short-lived, signed, HttpOnly cookie.

    Login CSRF (a page logging the victim into the attacker's account) is refused because
    the posted field must match the cookie this site set on the form's GET.
    """
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        _serializer(request, _LOGIN_SALT).dumps(token),
        max_age=LOGIN_FORM_MAX_AGE_S,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=_is_https(request),
    )


def check_login_token(request: Request, form_token: str | None) -> bool:
    """True when the posted login form token matches this browser's login cookie."""
    raw = request.cookies.get(LOGIN_CSRF_COOKIE)
    if not raw or not form_token:
        return False
    try:
        expected = _serializer(request, _LOGIN_SALT).loads(raw, max_age=LOGIN_FORM_MAX_AGE_S)
    except (SignatureExpired, BadSignature):
        return False
    return isinstance(expected, str) and tokens_match(expected, form_token) and _same_origin(
        request
    )


def session_api_key(db: Session, request: Request) -> ApiKey | None:
    """The live API key row behind this request's dashboard session, or None.

    None when there is no valid cookie, the session was logged out, or the key was
    deleted or revoked since login (revocation ends dashboard sessions at once). Raises ``CsrfError`` for an unsafe
    request without the session's CSRF token. This is what ``api/deps.py`` calls when a
    request carries no ``Authorization`` header.
    """
    session = read_session(request)
    if session is None:
        return None
    check_csrf(request, session)
    if db.get(RevokedUiSession, session.session_id) is not None:
        return None  # logged out: this cookie is a leftover copy
    key = db.get(ApiKey, session.key_id)
    if key is None or key.revoked_at is not None:
        return None
    return key
