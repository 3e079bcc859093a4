"""`tunefleet models`: the base models and fine-tuned adapters a tenant can use."""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

from tunefleet.cli.options import ApiKeyOpt, BaseUrlOpt, JsonOpt, connected
from tunefleet.cli.render import fmt_time, print_list


def models(json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None) -> None:
    """Base models and fine-tuned adapters you can use."""
    with connected(json_out, base_url, api_key) as client:
        items = list(client.models.list())
    rows = ((m.id, m.owned_by, fmt_time(m.created)) for m in items)
    print_list(json_out, items, "models", ["id", "owned by", "created"], rows)
