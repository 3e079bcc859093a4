"""The `tunefleet` command line: client commands for users, operator commands for the service.

Client commands (files, jobs, estimate, pools) live in `tunefleet.cli.commands`;
operator commands (serve, worker, scheduler, db, admin) in `tunefleet.cli.operator`.
Both register themselves on `app`.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="tunefleet",
    help="Self-hosted LLM fine-tuning service: submit, watch and operate fine-tuning jobs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

from tunefleet.cli import commands as _commands  # noqa: F401  (registers client commands)
from tunefleet.cli import operator as _operator  # noqa: F401  (registers operator commands)
