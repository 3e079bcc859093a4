"""`tunefleet webhooks ...`: manage signed webhook endpoints and read their delivery log."""

# No `from __future__ import annotations`: typer reads these annotations at runtime.

from typing import Annotated

import typer

from tunefleet.cli.options import client_command
from tunefleet.cli.render import console, fmt_time, key_values, print_json, print_list
from tunefleet.sdk.client import Tunefleet

webhooks_app = typer.Typer(help="Signed webhook endpoints for job events.", no_args_is_help=True)


@webhooks_app.command("create")
@client_command
def webhooks_create(
    client: Tunefleet,
    json_out: bool,
    url: str,
    event: Annotated[list[str] | None, typer.Option("--event", help="Event type, repeatable; default all.")] = None,
    description: Annotated[str | None, typer.Option(help="Free text.")] = None,
) -> None:
    """Register an endpoint; prints its signing secret once."""
    ep = client.webhooks.create(url=url, events=event, description=description)
    if json_out:
        print_json(ep)
    else:
        console.print(key_values(f"webhook {ep.id}", [("url", ep.url), ("events", ", ".join(ep.events)),
                                                       ("secret", ep.secret)]))
        console.print("store the secret now: it is not shown again")


@webhooks_app.command("list")
@client_command
def webhooks_list(client: Tunefleet, json_out: bool) -> None:
    """List endpoints."""
    items = list(client.webhooks.list())
    rows = ((e.id, e.url, ", ".join(e.events), e.enabled, fmt_time(e.created_at)) for e in items)
    print_list(json_out, items, "webhooks", ["id", "url", "events", "enabled", "created"], rows, has_more=False)


@webhooks_app.command("delete")
@client_command
def webhooks_delete(client: Tunefleet, json_out: bool, endpoint_id: str) -> None:
    """Delete an endpoint."""
    result = client.webhooks.delete(endpoint_id)
    print_json(result) if json_out else console.print(f"deleted {result.id}")


@webhooks_app.command("rotate-secret")
@client_command
def webhooks_rotate(
    client: Tunefleet,
    json_out: bool,
    endpoint_id: str,
    grace_period_s: Annotated[int | None, typer.Option(help="Seconds the old secret keeps signing.")] = None,
) -> None:
    """Issue a new signing secret; the old one also signs during the grace period."""
    ep = client.webhooks.rotate_secret(endpoint_id, grace_period_s=grace_period_s)
    print_json(ep) if json_out else console.print(f"new secret: {ep.secret}")


@webhooks_app.command("deliveries")
@client_command
def webhooks_deliveries(client: Tunefleet, json_out: bool, endpoint_id: str) -> None:
    """The delivery log of an endpoint: each event, attempts, last answer."""
    items = client.webhooks.list_deliveries(endpoint_id).data
    rows = ((d.id, d.event_type, d.status, d.attempts, d.response_status, d.last_error) for d in items)
    print_list(json_out, items, f"deliveries of {endpoint_id}", ["id", "event", "status", "attempts", "http", "error"],
               rows)
