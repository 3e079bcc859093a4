"""`tunefleet models`: the base models and fine-tuned adapters a tenant can use."""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

from tunefleet.cli.options import client_command
from tunefleet.cli.render import fmt_time, print_list
from tunefleet.sdk.client import Tunefleet


@client_command
def models(client: Tunefleet, json_out: bool) -> None:
    """Base models and fine-tuned adapters you can use."""
    items = list(client.models.list())
    rows = ((m.id, m.owned_by, fmt_time(m.created)) for m in items)
    print_list(json_out, items, "models", ["id", "owned by", "created"], rows)
