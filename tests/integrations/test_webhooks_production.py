"""The webhook delivery scenario on the production stack: PostgreSQL + Redis broker.

Same scenario as ``test_webhooks.test_job_events_are_signed_delivered_and_retried_by_celery``
(outbox rows written in the transition's transaction, Celery worker on Redis, retries
after 500s, receiver verifying with ``standardwebhooks``). Skipped locally when
PostgreSQL or Redis is unreachable, a failure under ``CI=true`` (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import flush_redis_db, make_settings, own_pg_database
from tests.integrations.test_webhooks import (  # noqa: F401 (fixtures)
    receiver,
    sdk,
    test_job_events_are_signed_delivered_and_retried_by_celery,
    webhook_env,
)
from tests.model_files import install_demo_model


@pytest.fixture
def settings(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Any]:
    from control.db.migrate import upgrade

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    flush_redis_db(redis_url)  # its worker must run none of an earlier test's tasks
    # ... nor validate an earlier test's files: a worker re-sends the validation of every
    # file it finds still `uploaded` when it starts, and on the session's shared database
    # that was another test's file, missing from this data dir (a traceback in its log).
    with own_pg_database(pg_url, tmp_path.name) as database_url:
        upgrade(database_url)
        made = make_settings(data_dir, database_url=database_url, broker_url=redis_url)
        install_demo_model(made.models_dir)  # a service has the files of the models it lists
        yield made
