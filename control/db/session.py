"""Engines and sessions: one engine per database URL per process.

SQLite is tuned for several processes (API, worker, scheduler) sharing one file: WAL
journal, a busy timeout instead of immediate "database is locked" errors, and foreign
keys on (SQLite leaves them off by default).

Every engine "pre-pings" a pooled connection when it is checked out (see ``get_engine``).
JSON columns are parsed by pydantic-core's parser on both databases (``_json_loads``):
the stdlib parser dominated the CPU time of listing jobs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic_core import from_json
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

_engines: dict[str, Engine] = {}
POOL_RECYCLE_S = 300
_lock = threading.Lock()


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=15000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _json_loads(data: bytes | str) -> Any:
    """Parse a JSON column value: pydantic-core's parser, ~5-50x faster than ``json.loads``.

    A page of 20 jobs holds ~170 JSON values; with the stdlib parser decoding them cost
    more CPU than the rest of the request. Anything it refuses (PostgreSQL's ``json``
    type keeps the text as written) goes to the stdlib parser, so nothing that loaded
    before stops loading.
    """
    try:
        return from_json(data)
    except ValueError:
        return json.loads(data)


def _psycopg_fast_json(dbapi_connection, _record) -> None:
    from psycopg.types.json import set_json_loads  # only engines on psycopg get here

    set_json_loads(_json_loads, dbapi_connection)


def get_engine(url: str) -> Engine:
    """The process-wide engine for ``url`` (created on first use)."""
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            # pool_pre_ping: a pooled connection is tested (a trivial round trip) when it
            # is checked out and replaced if the server closed it. Without it the first
            # requests after a database restart (or a proxy dropping idle connections)
            # got a dead connection and answered 500; recycling alone cannot know.
            if url.startswith("sqlite"):
                engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 15},
                                       json_deserializer=_json_loads, pool_pre_ping=True)
                event.listen(engine, "connect", _sqlite_pragmas)
            else:
                engine = create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True,
                                       pool_recycle=POOL_RECYCLE_S, pool_use_lifo=True)
                if engine.dialect.driver == "psycopg":
                    event.listen(engine, "connect", _psycopg_fast_json)
            _engines[url] = engine
        return engine


def dispose_engine(url: str) -> None:
    """Close the pooled connections of ``url`` (tests drop their databases afterwards)."""
    with _lock:
        engine = _engines.pop(url, None)
    if engine is not None:
        engine.dispose()


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


def begin_write(session: Session) -> None:
    """Make a read-then-write atomic on SQLite, as ``SELECT … FOR UPDATE`` is on PostgreSQL.

    pysqlite opens its (deferred) transaction only at the first INSERT/UPDATE/DELETE, so
    two processes could both read a job as ``queued`` and both move it on. ``BEGIN
    IMMEDIATE`` takes SQLite's write lock before the read (waiting up to busy_timeout); a
    connection that has written already holds it. Keep such transactions short: on SQLite
    the lock covers the whole database.
    """
    if session.get_bind().dialect.name != "sqlite":
        return
    dbapi_connection = session.connection().connection.dbapi_connection
    if not dbapi_connection.in_transaction:
        dbapi_connection.execute("BEGIN IMMEDIATE")


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (for tasks and CLI)."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
