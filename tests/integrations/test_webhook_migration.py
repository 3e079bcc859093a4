"""The webhook tables created by Alembic match the SQLAlchemy models (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

WEBHOOK_TABLES = {"webhook_endpoints", "webhook_deliveries"}


def _tables_in(diff: Any) -> set[str]:
    """Table names a (possibly nested) autogenerate diff entry mentions."""
    if isinstance(diff, list):
        return set().union(*(_tables_in(d) for d in diff)) if diff else set()
    names = set()
    for part in diff:
        table = getattr(part, "table", None)
        name = getattr(part, "name", None)
        if table is not None and getattr(table, "name", None):
            names.add(table.name)
        elif isinstance(name, str):
            names.add(name)
        elif isinstance(part, str):
            names.add(part)
    return names


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_webhook_migration_matches_models(backend: str, request: pytest.FixtureRequest) -> None:
    from api.db.base import Base
    from api.db.session import get_engine
    from api.webhooks import models  # noqa: F401 (registers the webhook tables)

    if backend == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('sqlite_template')}"
    else:
        url = request.getfixturevalue("pg_url")
    with get_engine(url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diffs = compare_metadata(context, Base.metadata)
        tables = set(connection.dialect.get_table_names(connection))
    assert WEBHOOK_TABLES <= tables
    ours = [d for d in diffs if _tables_in(d) & WEBHOOK_TABLES]
    assert ours == []
