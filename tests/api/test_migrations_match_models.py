"""The Alembic migrations build exactly the schema the models declare, on both databases.

The schema changes only through migrations; a model change without one (or a migration
that differs from its model) shows up here as an autogenerate diff.
"""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrated_schema_equals_the_models(backend: str, request: pytest.FixtureRequest) -> None:
    from api.ui import models as ui_models  # noqa: F401 (registers the dashboard's table)
    from control.db.base import Base
    from control.db.session import get_engine
    from control.webhooks import models  # noqa: F401 (registers the webhook tables)

    if backend == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('sqlite_template')}"
    else:
        url = request.getfixturevalue("pg_url")
    with get_engine(url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diffs = compare_metadata(context, Base.metadata)
    assert diffs == []
