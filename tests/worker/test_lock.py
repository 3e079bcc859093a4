"""Scheduler locks: only one holder; re-entrant for the holder; a lost lease is not renewed."""

import subprocess
import sys
import time

import pytest

from worker.scheduler.lock import FileLock, InProcessLock, PostgresAdvisoryLock, RedisLock


def test_file_lock_excludes_another_process(tmp_path):
    path = tmp_path / "scheduler.lock"
    mine = FileLock(path)
    assert mine.acquire() and mine.acquire()  # re-entrant
    probe = ("import sys; from worker.scheduler.lock import FileLock; "
             f"sys.exit(0 if FileLock({str(path)!r}).acquire() else 3)")
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 3
    mine.release()
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_in_process_lock():
    import threading

    lock, got = InProcessLock(), []
    assert lock.acquire()
    t = threading.Thread(target=lambda: got.append(lock.acquire()))
    t.start()
    t.join()
    assert got == [False]
    lock.release()


@pytest.mark.redis
def test_redis_lease(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    a, b = RedisLock(client, ttl_ms=300), RedisLock(client, ttl_ms=300)
    assert a.acquire() and not b.acquire()
    assert a.acquire()  # renews its own lease
    b.release()  # not the holder: must not delete a's lease
    assert not b.acquire()
    time.sleep(0.4)  # a's lease expires (a replica that hung)
    assert b.acquire()
    assert not a.acquire()  # the old holder cannot renew b's lease
    b.release()
    assert a.acquire()
    a.release()


@pytest.mark.postgres
def test_postgres_advisory_lock(pg_url):
    from control.db.session import get_engine

    engine = get_engine(pg_url)
    a, b = PostgresAdvisoryLock(engine, key=4242), PostgresAdvisoryLock(engine, key=4242)
    assert a.acquire() and not b.acquire()
    a.release()
    assert b.acquire()
    b.release()


@pytest.mark.parametrize("backend", ["file", "redis", "postgres"])
def test_the_gauge_exporter_lease_is_apart_from_the_schedulers(backend, tmp_path, request):
    """A replica keeps the exporter lease while another takes the scheduler's for a cycle,
    and a second replica gets neither while they are held, on every lock store."""
    from tests.conftest import make_settings
    from worker.scheduler.lock import make_lock

    overrides, engine = {}, None
    if backend == "redis":
        overrides["broker_url"] = request.getfixturevalue("redis_url")
    elif backend == "postgres":
        from control.db.session import get_engine

        overrides["database_url"] = request.getfixturevalue("pg_url")
        engine = get_engine(overrides["database_url"])
    settings = make_settings(tmp_path, **overrides)
    exporter, scheduler = make_lock(settings, engine, exporter=True), make_lock(settings, engine)
    other_exporter, other_scheduler = make_lock(settings, engine, exporter=True), make_lock(settings, engine)
    assert exporter.acquire() and scheduler.acquire()
    assert not other_exporter.acquire() and not other_scheduler.acquire()
    scheduler.release()  # the end of a cycle: the other replica may run the next one
    assert other_scheduler.acquire() and not other_exporter.acquire() and exporter.acquire()
    for lock in (exporter, other_scheduler):
        lock.release()
    assert other_exporter.acquire()
    other_exporter.release()
