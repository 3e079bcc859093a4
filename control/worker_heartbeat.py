"""The worker's heartbeat: proof for ``/readyz`` that a Celery worker is consuming tasks.

A broker that accepts connections says nothing about the workers: a worker stopped by an
unrecoverable consumer error leaves tasks piling up in a healthy Redis. The worker writes
a timestamp every ``BEAT_INTERVAL_S`` from its consumer's own timer (``worker.celery_app``),
so beats stop as soon as the consumer stops, and ``/readyz`` calls a beat older than
``STALE_AFTER_S`` a dead worker.

Where the beat lives follows the broker: a key with an expiry in Redis (every API
replica and worker sees it), or a file in the data directory for the embedded
server-less broker (which is single-host by construction).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from control.settings import Settings

BEAT_INTERVAL_S = 10.0
STALE_AFTER_S = 45.0
REDIS_KEY = "tunefleet:worker-heartbeat"
FILE_NAME = "worker-heartbeat"
_TIMEOUT_S = 2.0  # both sides: a slow broker must not stall the consumer or /readyz


def _redis_url(settings: Settings) -> str | None:
    url = settings.resolved_broker_url
    return url if url.startswith(("redis://", "rediss://")) else None


def beat(settings: Settings, *, now: float | None = None) -> None:
    """Record that a worker of this service is alive now."""
    value = json.dumps({"at": time.time() if now is None else now,
                        "worker": f"{socket.gethostname()}:{os.getpid()}"})
    url = _redis_url(settings)
    if url is None:
        path = settings.data_path / FILE_NAME
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        tmp.replace(path)
        return
    import redis

    client = redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)
    try:
        client.set(REDIS_KEY, value, ex=int(STALE_AFTER_S * 2))
    finally:
        client.close()


def last_beat(settings: Settings) -> float | None:
    """Unix time of the newest beat, or None when no worker ever beat (or it expired)."""
    url = _redis_url(settings)
    if url is None:
        path: Path = settings.data_path / FILE_NAME
        raw = path.read_text() if path.exists() else None
    else:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S,
                                      socket_connect_timeout=_TIMEOUT_S)
        try:
            raw = client.get(REDIS_KEY)
        finally:
            client.close()
    if not raw:
        return None
    return float(json.loads(raw)["at"])


def check_worker(settings: Settings, *, now: float | None = None) -> str | None:
    """None when a worker beat within ``STALE_AFTER_S``; else why the worker counts as dead."""
    at = last_beat(settings)
    if at is None:
        return "no worker heartbeat: no Celery worker has consumed from this broker"
    age = (time.time() if now is None else now) - at
    if age > STALE_AFTER_S:
        return f"no worker heartbeat for {age:.0f} s (a worker beats every {BEAT_INTERVAL_S:.0f} s)"
    return None
