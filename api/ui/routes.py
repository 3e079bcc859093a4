"""The dashboard's pages: login/logout and four server-rendered shells at ``/ui``.

Each page route checks the session, renders the layout with the principal (tenant, key
prefix, admin or not) and the few ids the page script needs, and leaves the data to the
page's JavaScript, which calls the public JSON API (``/v1/...``) with the session cookie.
The one exception is the job page: it answers a real 404 page for a job this principal
may not see (another tenant's job looks exactly like a missing one).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from api.deps import SessionDep
from api.jobs.queries import may_open
from api.ui import session as ui_session
from api.ui.data import router as data_router
from api.ui.headers import DashboardHeadersMiddleware
from control.auth import authenticate
from control.db.models import ApiKey, Job, Tenant
from control.errors import APIError

UI_DIR = Path(__file__).parent
STATIC_DIR = UI_DIR / "static"
templates = Jinja2Templates(directory=str(UI_DIR / "templates"))

router = APIRouter(prefix="/ui", include_in_schema=False)


@lru_cache(maxsize=64)
def _static_version(name: str) -> str:
    """Content hash of a static file, so browsers refetch it exactly when it changes."""
    return hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest()[:12]


def static_url(name: str) -> str:
    return f"/ui/static/{name}?v={_static_version(name)}"


templates.env.globals["static"] = static_url


@dataclass(frozen=True)
class Principal:
    """Who is looking at the dashboard (never the key itself)."""

    key_id: str
    key_prefix: str
    tenant_id: str
    tenant_name: str
    is_admin: bool


class LoginRequired(Exception):
    """Raised by page dependencies without a session; answered with a redirect to login."""

    def __init__(self, next_path: str) -> None:
        self.next_path = next_path


def _principal_of(key: ApiKey) -> Principal:
    return Principal(
        key_id=key.id,
        key_prefix=key.prefix,
        tenant_id=key.tenant_id,
        tenant_name=key.tenant.name,
        is_admin=key.grants_admin,
    )


def page_session(request: Request, db: SessionDep) -> tuple[Principal, ui_session.UiSession]:
    """The signed-in principal and session of a page request, else ``LoginRequired``."""
    state = ui_session.read_session(request)
    key = ui_session.session_api_key(db, request) if state else None
    if key is None or state is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target)
    return _principal_of(key), state


PageSession = Annotated[tuple[Principal, ui_session.UiSession], Depends(page_session)]


def render(
    request: Request,
    template: str,
    auth: tuple[Principal, ui_session.UiSession],
    *,
    title: str,
    nav: str | None = None,
    page: dict[str, Any] | None = None,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    principal, state = auth
    page_data = {"principal": asdict(principal), **(page or {})}
    response = templates.TemplateResponse(
        request,
        template,
        {
            "title": title,
            "nav": nav,
            "principal": principal,
            "csrf_token": state.csrf_token,
            "page_data": page_data,
            **context,
        },
        status_code=status_code,
    )
    # Pages hold a CSRF token and tenant data: never cache them, never frame them.
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    return response


def _safe_next(value: str | None) -> str:
    """Only same-site dashboard paths are valid redirect targets after login (no open redirect)."""
    if value and value.startswith("/ui") and not value.startswith("//") and "\\" not in value:
        return value
    return "/ui/"


# ---- login / logout -----------------------------------------------------------------


@router.get("/login", response_model=None, response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None) -> HTMLResponse:
    return _login_form(request, next_path=_safe_next(next))


def _login_form(
    request: Request, *, next_path: str, error: str | None = None, status_code: int = 200
) -> HTMLResponse:
    token = ui_session.new_login_token()
    response = templates.TemplateResponse(
        request,
        "login.html",
        {"next": next_path, "error": error, "login_token": token},
        status_code=status_code,
    )
    ui_session.set_login_cookie(response, request, token)
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Frame-Options"] = "DENY"
    return response


@router.post("/login", response_model=None, response_class=HTMLResponse)
def login(
    request: Request,
    db: SessionDep,
    api_key: Annotated[str, Form()] = "",
    csrf_token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/ui/",
) -> Response:
    next_path = _safe_next(next)
    if not ui_session.check_login_token(request, csrf_token):
        return _login_form(
            request,
            next_path=next_path,
            error="The sign-in form expired or came from another site. Please try again.",
            status_code=403,
        )
    try:
        key = authenticate(db, f"Bearer {api_key.strip()}")
    except APIError:
        return _login_form(
            request,
            next_path=next_path,
            error="That API key is not valid (unknown, malformed or revoked).",
            status_code=401,
        )
    response = RedirectResponse(next_path, status_code=303)
    ui_session.start_session(response, request, key.id)
    response.delete_cookie(ui_session.LOGIN_CSRF_COOKIE, path="/ui")
    return response


@router.post("/logout", response_model=None)
def logout(request: Request, db: SessionDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    state = ui_session.read_session(request)
    if state is not None:
        ui_session.check_csrf(request, state, form_token=csrf_token)
    response = RedirectResponse("/ui/login", status_code=303)
    ui_session.end_session(response, db, state)
    db.commit()
    return response


# ---- pages --------------------------------------------------------------------------


@router.get("", response_model=None, include_in_schema=False)
def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/", response_model=None, response_class=HTMLResponse)
def jobs_page(request: Request, auth: PageSession) -> HTMLResponse:
    return render(request, "jobs.html", auth, title="Jobs", nav="jobs")


@router.get("/new", response_model=None, response_class=HTMLResponse)
def new_job_page(request: Request, auth: PageSession) -> HTMLResponse:
    return render(request, "new_job.html", auth, title="New fine-tuning job", nav="new")


@router.get("/pools", response_model=None, response_class=HTMLResponse)
def pools_page(request: Request, auth: PageSession) -> HTMLResponse:
    return render(request, "pools.html", auth, title="Queue & pools", nav="pools")


@router.get("/jobs/{job_id}", response_model=None, response_class=HTMLResponse)
def job_page(request: Request, job_id: str, auth: PageSession, db: SessionDep) -> HTMLResponse:
    principal, _ = auth
    job = db.get(Job, job_id)
    if job is None or not may_open(job, tenant_id=principal.tenant_id, is_admin=principal.is_admin):
        return render(
            request,
            "not_found.html",
            auth,
            title="Job not found",
            nav="jobs",
            status_code=404,
            heading="Job not found",
            message=f"There is no fine-tuning job '{job_id}' in your organization.",
        )
    # An admin looking at another organization's job is told whose it is.
    owner = db.get(Tenant, job.tenant_id).name if job.tenant_id != principal.tenant_id else None
    return render(
        request, "job.html", auth, title=job_id, nav="jobs", page={"job_id": job_id}, job_id=job_id,
        owner=owner,
    )


def login_redirect(_request: Request, exc: LoginRequired) -> RedirectResponse:
    """Exception handler: a page without a session goes to the login form, then back."""
    return RedirectResponse(f"/ui/login?next={quote(exc.next_path, safe='/')}", status_code=303)


def mount_ui(app: Any) -> None:
    """Add the dashboard to ``app``: the page router, static assets, the login redirect."""
    app.include_router(router)
    app.include_router(data_router)
    app.mount("/ui/static", StaticFiles(directory=str(STATIC_DIR)), name="ui-static")
    app.add_exception_handler(LoginRequired, login_redirect)
    app.add_middleware(DashboardHeadersMiddleware)

