"""`tunefleet login` and `tunefleet config`: the service URL and API key the CLI uses.

``login`` checks the key against the service, then saves both to the config file
(``tunefleet.sdk.config``, mode 0600); ``config`` shows what the CLI resolves from
arguments, environment and that file.
"""

# No `from __future__ import annotations`: typer reads these annotations at runtime.

from typing import Annotated

import typer
from rich.text import Text

from tunefleet.cli.options import JsonOpt, exit_on_error
from tunefleet.cli.render import console, key_values, print_json
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.config import config_path, normalize_base_url, resolve_config, write_config_file


def login(
    base_url: Annotated[str, typer.Option("--base-url", prompt="Service URL", help="Service URL.")],
    api_key: Annotated[str, typer.Option("--api-key", prompt="API key", hide_input=True, help="API key.")],
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the key first.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Save the service URL and API key to the config file (mode 0600)."""
    with exit_on_error(json_out):
        url = normalize_base_url(base_url)
        if verify:
            with Tunefleet(base_url=url, api_key=api_key, max_retries=1) as client:
                client.jobs.list(limit=1)
        path = write_config_file({"base_url": url, "api_key": api_key})
    if json_out:
        print_json({"config": str(path), "base_url": url})
    else:
        console.print(Text(f"saved {url} to {path}"))


def show_config(json_out: JsonOpt = False) -> None:
    """Show where the CLI finds its URL and key (the key is masked)."""
    with exit_on_error(json_out):
        cfg = resolve_config()
    masked = None if not cfg.api_key else cfg.api_key[:12] + "..."
    out = {"config_file": str(config_path()), "base_url": cfg.base_url, "api_key": masked}
    print_json(out) if json_out else console.print(key_values("config", list(out.items())))
