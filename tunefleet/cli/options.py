"""What the CLI's commands share: common options, exit codes, and how errors end a command.

Client commands take ``--json`` for scripts plus ``--base-url`` / ``--api-key`` (else
``TUNEFLEET_BASE_URL`` / ``TUNEFLEET_API_KEY``, else the config file written by
``tunefleet login``) and talk to the service through the SDK inside ``connected``, which
turns SDK errors into a message (or JSON on stderr) and a stable exit code;
``client_command`` gives a command those three options and the connected client. Operator
commands read the service's own settings through ``load_settings``.

Exit codes: 0 ok; 1 the service answered an error or could not be reached; 2 usage
error or invalid configuration; 3 the job (``watch``/``--wait``) ended failed or
cancelled, or a file failed validation; 4 a wait timed out.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tunefleet.cli.render import report_error
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.errors import APIStatusError, TunefleetError, WaitTimeoutError

if TYPE_CHECKING:
    from control.settings import Settings

EXIT_API_ERROR = 1
EXIT_INVALID_CONFIGURATION = 2
EXIT_JOB_FAILED = 3
EXIT_TIMEOUT = 4

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts) instead of tables.")]
BaseUrlOpt = Annotated[
    str | None, typer.Option("--base-url", help="Service URL (default: env, config, http://127.0.0.1:8000).")
]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="API key (default: env or config).")]
LimitOpt = Annotated[int, typer.Option("--limit", min=1, max=100, help="Items per page.")]
AfterOpt = Annotated[str | None, typer.Option("--after", help="Cursor: the last id of the previous page.")]
AllOpt = Annotated[bool, typer.Option("--all", help="Follow the cursor through every page.")]


# A 401 for a request sent without a key: point at how the CLI gets one.
KEY_ERRORS = frozenset({"missing_api_key"})
KEY_HINT = "Run `tunefleet login`, set TUNEFLEET_API_KEY, or pass --api-key."


@contextlib.contextmanager
def exit_on_error(json_out: bool) -> Iterator[None]:
    """Turn SDK errors into a message (or JSON on stderr) and a stable exit code."""
    try:
        yield
    except WaitTimeoutError as exc:
        report_error({"message": exc.message, "code": "wait_timeout"}, json_out)
        raise typer.Exit(EXIT_TIMEOUT) from None
    except APIStatusError as exc:
        message = exc.message
        if exc.code in KEY_ERRORS:
            # The server's text speaks HTTP (a Bearer header); a CLI user needs the CLI's way in.
            message = f"{message} {KEY_HINT}"
        report_error(
            {"message": message, "type": exc.type, "param": exc.param, "code": exc.code, "status": exc.status},
            json_out,
        )
        raise typer.Exit(EXIT_API_ERROR) from None
    except TunefleetError as exc:
        report_error({"message": str(exc), "code": type(exc).__name__}, json_out)
        raise typer.Exit(EXIT_API_ERROR) from None


@contextlib.contextmanager
def connected(json_out: bool, base_url: str | None, api_key: str | None) -> Iterator[Tunefleet]:
    """A client for one command; SDK errors inside (configuration included) end the command."""
    with exit_on_error(json_out), Tunefleet(base_url=base_url, api_key=api_key) as client:
        yield client


# The options every client command ends with, in this order (see ``client_command``).
CONNECTION_PARAMETERS = [
    inspect.Parameter("json_out", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=JsonOpt),
    inspect.Parameter("base_url", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=BaseUrlOpt),
    inspect.Parameter("api_key", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ApiKeyOpt),
]


def client_command(func: Callable[..., None]) -> Callable[..., None]:
    """Make ``func(client, json_out, <its own arguments and options>)`` a client command.

    The command line gets ``--json``, ``--base-url`` and ``--api-key`` after ``func``'s own
    parameters, and ``func`` runs with a client from ``connected``: every command connects,
    and ends on SDK errors, the same way. Typer builds the command from the signature
    set here, so ``client`` and ``json_out`` never appear as options of their own.
    """
    own = list(inspect.signature(func).parameters.values())[2:]
    parameters = [*own, *CONNECTION_PARAMETERS]

    @functools.wraps(func)
    def command(*, json_out: bool = False, base_url: str | None = None, api_key: str | None = None,
                **options: Any) -> None:
        with connected(json_out, base_url, api_key) as client:
            func(client, json_out, **options)

    command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return command


def page_items(page: Any, fetch_all: bool) -> tuple[list[Any], bool]:
    """The items to print and whether more follow: one page, or every page with ``--all``."""
    if fetch_all:
        return list(page), False
    return page.data, page.has_more


def load_settings(json_out: bool = False) -> Settings:
    """The service's settings from the environment; invalid ones end the command with exit 2."""
    from control.settings import get_settings

    try:
        return get_settings()
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        report_error({"message": f"invalid configuration: {exc}", "code": "invalid_configuration"}, json_out)
        raise typer.Exit(EXIT_INVALID_CONFIGURATION) from exc
