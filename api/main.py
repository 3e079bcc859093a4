"""The FastAPI application factory: ``uvicorn --factory api.main:create_app``.

``create_app(settings)`` wires the pieces (database engine, task queue, artifact stores,
base-model registry, error envelope, routers) into ``app.state`` so routes receive them
through ``api.deps``. It does not migrate the database: ``tunefleet db upgrade`` (or
``tunefleet serve``, for the embedded SQLite database) does.
"""

from __future__ import annotations

import logging
import re
import time

from fastapi import FastAPI

from api import observability, rate_limits, webhooks
from api.admin import routes as admin
from api.body_limit import BodySizeLimitMiddleware
from api.checkpoint_permissions import routes as checkpoint_permissions
from api.errors import install_error_handlers
from api.evaluations import routes as evaluations
from api.evaluations.runner import EvaluationRunner, running_evaluations
from api.files import routes as files
from api.fleet import routes as fleet_routes
from api.fleet.pools import install as install_fleet
from api.graders import routes as graders
from api.health import routes as health
from api.inference import routes as inference
from api.jobs import routes as jobs
from api.jobs.pages import CachedJobListMiddleware, JobPageCache
from api.models import routes as models
from api.openapi import install_openapi
from api.outputs import routes as outputs
from api.outputs.logs import kubernetes_log, register_log_reader
from api.outputs.stream import StreamSlots
from api.reports import routes as reports
from api.ui.routes import mount_ui
from api.uploads import routes as uploads
from control import inference_preload as preload
from control.artifacts import artifact_store, file_store
from control.db.session import get_engine, session_factory
from control.models.base_models import load_base_models
from control.queue import CeleryQueue, TaskQueue
from control.settings import Settings, get_settings

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, queue: TaskQueue | None = None) -> FastAPI:
    """Build the API app for ``settings`` (default: from the environment).

    Args:
        settings: the configuration; ``get_settings()`` when None.
        queue: where tasks are sent; a ``CeleryQueue`` on the configured broker when None
            (tests pass a queue that runs tasks inline or records them).
    """
    deployed = settings is None  # `uvicorn --factory`: the settings of the environment
    settings = settings or get_settings()
    settings.ensure_dirs()
    if deployed:
        _ensure_admin_key(settings)
    app = FastAPI(
        title="tunefleet",
        version="0.1.0",
        description="Self-hosted LLM fine-tuning service with an OpenAI-compatible API.",
        lifespan=running_evaluations,  # held-out evaluations under way: taken over at startup, given back at exit
    )
    url = settings.resolved_database_url
    app.state.settings = settings
    app.state.engine = get_engine(url)
    app.state.session_factory = session_factory(url)
    app.state.queue = queue if queue is not None else CeleryQueue(settings)
    app.state.store = artifact_store(settings)
    app.state.file_store = file_store(settings)
    app.state.base_models = load_base_models(settings)
    app.state.job_pages = JobPageCache()  # encoded job list pages (api/jobs/pages.py)
    app.state.started_at = int(time.time())
    app.state.stream_slots = StreamSlots(per_key=settings.stream_max_per_key,
                                         per_process=settings.stream_max_per_process)
    app.state.evaluations = EvaluationRunner(app)  # held-out evaluations run in this process (api/evaluations)
    install_error_handlers(app)
    install_fleet(app, settings)  # node pools + the Prometheus capacity provider
    if settings.executor == "kubernetes":
        register_log_reader(kubernetes_log)  # trainer logs from the pods (api/outputs/logs.py)
    for module in (health, files, uploads, jobs, checkpoint_permissions, outputs, models, reports, admin,
                   fleet_routes, inference, graders, evaluations):
        app.include_router(module.router)
    # The dashboard (api/ui), webhooks (api/webhooks) and Prometheus metrics
    # (api/observability) add their routers here.
    webhooks.install(app)
    preload.install(settings)  # a job that succeeds hints the inference worker to load its base
    # Inside the latency middleware (added after it), so cached answers are measured too.
    app.add_middleware(CachedJobListMiddleware, route=jobs.list_route())
    observability.install(app)
    mount_ui(app)
    install_openapi(app)  # 400 (not 422) and the auth errors, as answered
    # Outermost, so an oversized body is refused before routing and authentication.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes,
                       exempt=_is_file_upload)
    # Outside even that: a client over its rate limit is refused before anything reads its
    # request (api/rate_limits.py).
    rate_limits.install(app, settings)
    return app


def _ensure_admin_key(settings: Settings) -> None:
    """The deployment's admin key: ``TUNEFLEET_ADMIN_API_KEY`` installed, or one generated
    and printed once, at the first start (the Helm chart and the compose file start the API
    straight from uvicorn, and nothing else would)."""
    from sqlalchemy.exc import IntegrityError, SQLAlchemyError

    from control.bootstrap import ensure_admin_key
    from control.errors import APIError

    for attempt in range(2):
        try:
            new_key = ensure_admin_key(settings)
            break
        except (IntegrityError, APIError) as exc:
            # Another replica (API replicas of one Deployment start together on a fresh
            # database) created the admin tenant or key between our read and our write: a
            # unique-name check refusing the tenant, or a constraint the key. The second
            # pass sees what it committed. Anything else is not this race.
            if isinstance(exc, APIError) and exc.code != "tenant_exists":
                raise
            if attempt:
                return
        except SQLAlchemyError as exc:  # /readyz reports the database; the next start installs the key
            logger.warning("admin API key not installed: the database is not ready (%s)", exc)
            return
    if new_key is not None and settings.admin_api_key is None:
        print(f"tunefleet: the first admin API key (shown once): {new_key}", flush=True)


_UPLOAD_PART = re.compile(r"^/v1/uploads/[^/]+/parts$")


def _is_file_upload(scope: dict) -> bool:
    """``POST /v1/files`` and ``POST /v1/uploads/{id}/parts`` stream their bodies to disk
    under their own limits (api/files/uploads.py)."""
    path = scope.get("path", "")
    return scope.get("method") == "POST" and (path == "/v1/files" or _UPLOAD_PART.match(path) is not None)
