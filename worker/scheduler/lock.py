"""One active scheduler at a time: a lease that two replicas can never both hold.

A cycle runs only while its scheduler holds the lease, so two replicas of the
scheduler (or a Celery ``tunefleet.schedule`` task racing the loop) never place the same
job twice. Implementations, chosen by ``make_lock`` from the settings:

- ``RedisLock``: ``SET key token NX PX ttl``; renewal and release are compare-and-set
  Lua scripts, so a replica whose lease expired cannot extend or delete another's.
- ``PostgresAdvisoryLock``: ``pg_try_advisory_lock`` on a dedicated connection; the
  server drops it when the connection dies.
- ``FileLock``: ``flock`` on a file in the data dir (the embedded SQLite mode: every
  process is on one machine).
- ``InProcessLock``: threads of one process (tests, the single-process ``serve``).

``acquire()`` is re-entrant for the holder (it renews the lease); ``release()`` gives it
up. All return quickly: a scheduler that does not get the lease just skips the cycle.
The holder is the lock object, i.e. the process that made it: threads of one process
share it and take turns on ``worker.scheduler.loop.Components.mutex`` instead.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Protocol

LOCK_NAME = "tunefleet:scheduler"
# Advisory lock key: a fixed 64-bit number ("tfsched" in ASCII).
ADVISORY_KEY = 0x7466736368656400 >> 8


class SchedulerLock(Protocol):
    def acquire(self) -> bool: ...

    def release(self) -> None: ...


class InProcessLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            return True
        if self._lock.acquire(blocking=False):
            self._owner = me
            return True
        return False

    def release(self) -> None:
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()


class FileLock:
    """``flock`` on ``path``; one open file per holder (works across processes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._mutex = threading.Lock()

    def acquire(self) -> bool:
        with self._mutex:
            if self._fd is not None:
                return True
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._fd = fd
            return True

    def release(self) -> None:
        with self._mutex:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None


_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class RedisLock:
    """A lease in Redis: held while the key holds our token; expires after ``ttl_ms``."""

    def __init__(self, client: Any, key: str = LOCK_NAME, ttl_ms: int = 15_000) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = ttl_ms
        self.token = secrets.token_hex(16)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def acquire(self) -> bool:
        if self.client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return True
        # Already ours? Renew the lease (compare-and-set: never extends another's).
        return bool(self._renew(keys=[self.key], args=[self.token, self.ttl_ms]))

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.token])


class PostgresAdvisoryLock:
    """A session-level advisory lock held on one dedicated connection."""

    def __init__(self, engine: Any, key: int = ADVISORY_KEY) -> None:
        self.engine = engine
        self.key = key
        self._conn: Any = None

    def acquire(self) -> bool:
        from sqlalchemy import text

        if self._conn is not None:
            return True
        conn = self.engine.connect()
        got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar()
        conn.commit()
        if not got:
            conn.close()
            return False
        self._conn = conn
        return True

    def release(self) -> None:
        from sqlalchemy import text

        if self._conn is not None:
            self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            self._conn.commit()
            self._conn.close()
            self._conn = None


# The exporter lease (``make_lock(..., exporter=True)``): unlike the scheduler's, which
# each cycle takes and gives back, a scheduler replica keeps it while it lives, and only
# its holder exports the database gauges -- once per deployment, however many replicas.
EXPORTER_LOCK_NAME = "tunefleet:gauge-exporter"
EXPORTER_ADVISORY_KEY = ADVISORY_KEY + 1


def make_lock(settings: Any, engine: Any = None, *, exporter: bool = False) -> SchedulerLock:
    """The lock that fits the deployment: Redis broker > PostgreSQL DB > a file in the data
    dir. ``exporter``: the gauge exporter's lease instead of the scheduler's."""
    broker = settings.resolved_broker_url
    if broker.startswith(("redis://", "rediss://")):
        import redis

        return RedisLock(redis.Redis.from_url(broker), key=EXPORTER_LOCK_NAME if exporter else LOCK_NAME)
    if settings.resolved_database_url.startswith("postgresql") and engine is not None:
        return PostgresAdvisoryLock(engine, key=EXPORTER_ADVISORY_KEY if exporter else ADVISORY_KEY)
    return FileLock(Path(settings.data_path) / ("gauge-exporter.lock" if exporter else "scheduler.lock"))
