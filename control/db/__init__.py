"""The database: typed SQLAlchemy models, engine/session factory, Alembic migrations.

The schema is made ONLY by the Alembic migrations in ``control/db/migrations`` (``tunefleet db
upgrade`` or ``control.db.migrate.upgrade(url)``); nothing calls ``create_all``.
"""

# Registers the Session listeners that bump a tenant's job-change counter with every write
# to its jobs: imported here so that every process that can write a job (it imports
# ``control.db.models``, hence this package) counts its writes.
from control.db import job_versions  # noqa: F401
