"""`tunefleet db ...` and `tunefleet admin ...`: the operator's data commands.

``db upgrade`` applies the Alembic migrations; ``admin`` creates tenants and API keys
directly in the database the service's settings (``TUNEFLEET_*``) point at, so the first
key can be made before any key exists; ``admin manifests`` prints the Kubernetes objects
a job body would get on a pool (``tunefleet.cli.manifests``), creating nothing. Like the
client commands they take ``--json``: one
JSON document on stdout (the object the ``/v1/admin`` routes answer), errors as JSON on
stderr. The service's modules are imported inside each command, so the client commands
work where only the SDK is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunefleet.cli.options import EXIT_API_ERROR, EXIT_INVALID_CONFIGURATION, JsonOpt, load_settings
from tunefleet.cli.render import print_json, report_error

db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
admin_app = typer.Typer(help="Tenants, API keys, and what the executor would create.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    json_out: JsonOpt = False,
) -> None:
    """Apply the database migrations (creates the schema on an empty database)."""
    from control.db.migrate import current_revision, upgrade

    url = _database_url(json_out)
    upgrade(url, revision)
    now = current_revision(url)
    if json_out:
        print_json({"object": "database", "revision": now})
    else:
        typer.echo(f"database at revision {now}")


def _database_url(json_out: bool) -> str:
    """``TUNEFLEET_DATABASE_URL`` as the service reads it, and nothing else checked.

    Migrations need only the database: the serving checks of production (secret key,
    broker, metrics token) are not theirs, and the Helm chart's migration hook runs before
    the release's Secrets exist, with the database URL alone.
    """
    from control.settings import Settings

    try:
        return Settings(env="development").resolved_database_url
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        report_error({"message": f"invalid configuration: {exc}", "code": "invalid_configuration"}, json_out)
        raise typer.Exit(EXIT_INVALID_CONFIGURATION) from exc


@admin_app.command("create-tenant")
def create_tenant(
    name: str,
    admin: Annotated[bool, typer.Option("--admin", help="Tenant keys are admins.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Create a tenant (organization) and print its id."""
    from control.auth import create_tenant as create
    from control.auth import tenant_object
    from control.db.session import session_scope
    from control.errors import APIError

    settings = load_settings(json_out)
    try:
        with session_scope(settings.resolved_database_url) as session:
            tenant = tenant_object(create(session, name, is_admin=admin))
    except APIError as exc:
        report_error({"message": exc.message, "code": exc.code, "param": exc.param}, json_out)
        raise typer.Exit(EXIT_API_ERROR) from exc
    print_json(tenant) if json_out else typer.echo(tenant["id"])


@admin_app.command("create-key")
def create_key(
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant id (org-…) or name.")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin key.")] = False,
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Create an API key for a tenant and print it (it is shown only this once)."""
    from sqlalchemy import or_, select

    from control.auth import create_api_key, key_object
    from control.db.models import Tenant
    from control.db.session import session_scope

    settings = load_settings(json_out)
    with session_scope(settings.resolved_database_url) as session:
        row = session.scalar(select(Tenant).where(or_(Tenant.id == tenant, Tenant.name == tenant)))
        if row is None:
            report_error({"message": f"no tenant '{tenant}'", "code": "not_found", "param": "tenant"}, json_out)
            raise typer.Exit(EXIT_API_ERROR)
        key_row, raw = create_api_key(session, row, is_admin=admin, name=name)
        key = {**key_object(key_row), "key": raw}
    print_json(key) if json_out else typer.echo(key["key"])


@admin_app.command("list-tenants")
def list_tenants(json_out: JsonOpt = False) -> None:
    """List tenants (id, name, admin)."""
    from sqlalchemy import select

    from control.auth import tenant_object
    from control.db.models import Tenant
    from control.db.session import session_scope

    with session_scope(load_settings(json_out).resolved_database_url) as session:
        tenants = [tenant_object(t) for t in session.scalars(select(Tenant).order_by(Tenant.created_at))]
    if json_out:
        print_json({"object": "list", "data": tenants, "has_more": False})
        return
    for t in tenants:
        typer.echo(f"{t['id']}\t{t['name']}\t{'admin' if t['is_admin'] else ''}")


@admin_app.command("manifests")
def manifests(
    pool: Annotated[str, typer.Option("--pool", help="The node pool to place the job on.")],
    body: Annotated[Path, typer.Option("--body", exists=True, dir_okay=False,
                                       help="A POST /v1/fine_tuning/jobs body (JSON).")],
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant id for labels and quotas.")] = "org-preview",
    json_out: JsonOpt = False,
) -> None:
    """Print the Kubernetes objects (YAML) the executor would create for a job body on a
    pool, exactly as rendered at admission; nothing is created."""
    import json

    import yaml

    from tunefleet.cli.manifests import PreviewError, preview_manifests

    settings = load_settings(json_out)
    try:
        data = json.loads(body.read_text(encoding="utf-8"))
    except ValueError as exc:
        report_error({"message": f"{body}: not valid JSON: {exc}", "code": "invalid_json", "param": "body"},
                     json_out)
        raise typer.Exit(EXIT_INVALID_CONFIGURATION) from exc
    try:
        objects = preview_manifests(settings, data, pool, tenant=tenant).all()
    except PreviewError as exc:
        report_error({"message": exc.message, "code": exc.code, "param": exc.param}, json_out)
        raise typer.Exit(EXIT_INVALID_CONFIGURATION) from exc
    if json_out:
        print_json({"object": "list", "data": objects, "has_more": False})
    else:
        typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)
