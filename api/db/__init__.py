"""The database: typed SQLAlchemy models, engine/session factory, Alembic migrations.

The schema is made ONLY by the Alembic migrations in ``api/db/migrations`` (``tunefleet db
upgrade`` or ``api.db.migrate.upgrade(url)``); nothing calls ``create_all``.
"""
