"""`tunefleet pools`: the node pools with their GPU capacity, usage and queue."""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

from tunefleet.cli.options import client_command
from tunefleet.cli.render import fmt_value, print_list
from tunefleet.sdk.client import Tunefleet

# Columns in this order, each shown when any pool reports it.
POOL_COLUMNS = ["name", "accelerator", "trainer", "gpu_memory_gb", "gpus_total", "gpus_used", "gpus_free",
                "running_jobs", "queued_jobs", "price_per_gpu_hour"]


@client_command
def pools(client: Tunefleet, json_out: bool) -> None:
    """Node pools with their capacity and usage."""
    items = client.node_pools.list()
    present = [k for k in POOL_COLUMNS if any(k in p.to_dict() for p in items)] or ["name"]
    rows = ([fmt_value(p.to_dict().get(k)) for k in present] for p in items)
    print_list(json_out, items, "node pools", present, rows)
