"""``/healthz`` (the process answers) and ``/readyz`` (database and broker reachable, and a
worker consuming: its heartbeat is fresh, see ``control.worker_heartbeat``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text

from api.deps import EngineDep, SettingsDep
from api.health.schemas import HealthPublic, ReadinessPublic
from control.settings import Settings
from control.worker_heartbeat import check_worker

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic)
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _check_database(engine: Engine) -> str | None:
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return None
    except Exception as exc:  # noqa: BLE001 (report any failure as not ready)
        return f"{type(exc).__name__}: {exc}"[:300]


def _check_broker(url: str) -> str | None:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2, transport_options={"max_retries": 0}) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=2)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:300]


def _check_worker(settings: Settings) -> str | None:
    try:
        return check_worker(settings)
    except Exception as exc:  # noqa: BLE001 - an unreadable heartbeat is a missing one
        return f"{type(exc).__name__}: {exc}"[:300]


@router.get("/readyz", response_model=ReadinessPublic, responses={
    503: {"model": ReadinessPublic, "description": "A dependency is unreachable (see checks)."},
})
async def readyz(settings: SettingsDep, engine: EngineDep) -> JSONResponse:
    database = await run_in_threadpool(_check_database, engine)
    broker = await run_in_threadpool(_check_broker, settings.resolved_broker_url)
    worker = await run_in_threadpool(_check_worker, settings) if broker is None else (
        "not checked: the broker is unreachable")
    checks: dict[str, Any] = {"database": database or "ok", "broker": broker or "ok",
                              "worker": worker or "ok"}
    ready = database is None and broker is None and worker is None
    return JSONResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        status_code=200 if ready else 503)
