"""The `tunefleet` command line: client commands for users, operator commands for the service.

The root app is ``tunefleet.cli.main.app``; it is re-exported here, so
``from tunefleet.cli import app; app()`` runs the CLI without the console script.
"""

from tunefleet.cli.main import app

__all__ = ["app"]
