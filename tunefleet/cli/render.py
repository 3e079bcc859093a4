"""How CLI results look: rich tables for people, JSON for scripts.

Every client command, and the operator's ``db``/``admin`` commands, takes ``--json``
(``tunefleet.cli.options.JsonOpt``); with it the command prints exactly one JSON document on stdout (the API
object, or ``{"data": [...], "has_more": ...}`` for lists; ``jobs watch`` prints one
message per line) and errors go to stderr as ``{"error": {...}}`` (``report_error``), so
scripts can pipe into ``jq``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

console = Console()
err_console = Console(stderr=True)

def to_jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def print_json(value: Any) -> None:
    """One JSON document on stdout (plain write: rich would wrap long lines)."""
    sys.stdout.write(json.dumps(to_jsonable(value), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def report_error(error: dict[str, Any], json_out: bool) -> None:
    """An error on stderr: ``{"error": {...}}`` for scripts, one red line for people."""
    if json_out:
        err_console.file.write(json.dumps({"error": error}) + "\n")
        return
    where = f" (param: {error['param']})" if error.get("param") else ""
    code = f" [{error['code']}]" if error.get("code") else ""
    err_console.print(f"[red]error{escape(code)}:[/red] {escape(str(error['message']) + where)}", highlight=False)


def print_list(
    json_out: bool,
    items: list[Any],
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    has_more: bool | None = None,
    show_next_cursor: bool = False,
) -> None:
    """A list command's output: the list envelope as JSON, or a table of ``rows``.

    ``has_more`` goes into the envelope when given (routes without pagination answer
    without it); ``show_next_cursor`` adds the ``--after`` to pass for the next page.
    ``rows`` may be a generator: it is not consumed for JSON output.
    """
    if json_out:
        envelope: dict[str, Any] = {"object": "list", "data": items}
        if has_more is not None:
            envelope["has_more"] = has_more
        print_json(envelope)
        return
    console.print(table(title, columns, rows))
    if show_next_cursor and has_more:
        console.print(f"more: --after {items[-1].id}")


def print_json_line(value: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(value)) + "\n")
    sys.stdout.flush()


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_seconds(seconds: float | None) -> str:
    """A duration as people say it: ``45s``, ``3m 20s``, ``2h 05m``, ``1d 4h``."""
    if seconds is None or seconds < 0:
        return "-"
    seconds = round(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def fmt_count(n: float) -> str:
    """A large count (parameters) in K/M/B: ``135.0M``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def field_label(key: str) -> str:
    """A field's name for people: ``memory_per_gpu_bytes`` -> ``memory per gpu``."""
    if key.endswith("_bytes"):
        key = key.removesuffix("_bytes")
    elif _is_duration(key):
        key = key.removesuffix("_s")
    return key.replace("_", " ")


def _is_duration(key: str) -> bool:
    return key.endswith("_s") and not key.endswith("_per_s")


def fmt_field(key: str, value: Any, *, unit: str | None = None) -> str:
    """An API field's value for people, by its name: ``*_bytes`` in KiB/MiB/GiB, ``*_s`` as
    h/m/s, parameters in K/M/B, token counts and rates with thousands separators, objects
    as ``key=value`` lines, lists of text one per line.
    ``unit="bytes"`` formats every number of an object as bytes (a memory breakdown)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return "\n".join(f"{field_label(k)}={fmt_field(k, v, unit=unit)}" for k, v in value.items())
    if isinstance(value, list):
        return "\n".join(fmt_field(key, v, unit=unit) for v in value) if value else "-"
    if isinstance(value, (int, float)):
        if unit == "bytes" or key.endswith("_bytes"):
            return fmt_bytes(int(value))
        if _is_duration(key):
            return fmt_seconds(value)
        if key == "params":
            return fmt_count(value)
        if key.endswith("tokens") and isinstance(value, int):
            return f"{value:,}"
        if key == "cost":
            return f"{value:.2f}"
        if key.endswith("_per_s"):
            return f"{value:,.0f}"
    return fmt_value(value)


def fmt_value(value: Any) -> str:
    """A metric or estimate value in a table cell: JSON for structures, 4 significant digits."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


STATUS_STYLE = {
    "succeeded": "green",
    "processed": "green",
    "running": "cyan",
    "queued": "yellow",
    "validating_files": "yellow",
    "uploaded": "yellow",
    "paused": "magenta",
    "failed": "red",
    "error": "red",
    "cancelled": "dim",
}


def status_markup(status: str | None) -> str:
    """The status as rich markup (for format strings such as progress columns)."""
    if status is None:
        return "-"
    style = STATUS_STYLE.get(status)
    return f"[{style}]{escape(status)}[/{style}]" if style else escape(status)


def status_text(status: str | None) -> Text:
    """The status as a styled ``Text`` (table cells and prints)."""
    return Text(status or "-", style=STATUS_STYLE.get(status or "", ""))


def _cell(value: Any) -> Text:
    """Table cells are plain text: user data such as 'messages[0]' must not parse as markup."""
    if isinstance(value, Text):
        return value
    return Text("-" if value is None else str(value))


def is_id_column(name: str) -> bool:
    """An id a user copies whole into the next command: ``id``, ``job id``, ``file_id``, ..."""
    return name == "id" or name.endswith((" id", "_id"))


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """Id columns never wrap (an id folded over two lines cannot be copied); the other
    columns fold to make room for them in a narrow terminal."""
    t = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        if is_id_column(column):
            t.add_column(column, no_wrap=True, overflow="ignore")
        else:
            t.add_column(column, overflow="fold")
    for row in rows:
        t.add_row(*[_cell(v) for v in row])
    return t


def key_values(title: str, pairs: Sequence[tuple[str, Any]]) -> Table:
    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for key, value in pairs:
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        t.add_row(key, _cell(value))
    return t
