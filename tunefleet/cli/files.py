"""`tunefleet files ...`: upload training files, read their validation result, manage them."""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from tunefleet.cli.options import (
    EXIT_JOB_FAILED,
    AfterOpt,
    AllOpt,
    ApiKeyOpt,
    BaseUrlOpt,
    LimitOpt,
    client_command,
    connected,
    page_items,
)
from tunefleet.cli.render import (
    console,
    fmt_bytes,
    fmt_time,
    key_values,
    print_json,
    print_list,
    status_text,
    table,
)
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.types import FileObject

files_app = typer.Typer(help="Upload and inspect training files.", no_args_is_help=True)


def print_file(f: FileObject) -> None:
    """One file with its validation summary and, when it failed, the line-numbered errors."""
    pairs = [
        ("id", f.id), ("filename", f.filename), ("purpose", f.purpose), ("bytes", fmt_bytes(f.bytes)),
        ("created", fmt_time(f.created_at)), ("status", f.status),
    ]
    extra = f.model_extra or {}
    validation = extra.get("validation")
    if isinstance(validation, dict):
        for key in ("format", "n_examples", "n_tokens_estimate", "n_errors"):
            if validation.get(key) is not None:
                pairs.append((key, validation[key]))
    if f.status_details:
        pairs.append(("details", f.status_details))
    console.print(key_values(f"file {f.id}", pairs))
    errors = f.validation_errors()
    if errors:
        rows = [(e.line, e.code, e.message) for e in errors]
        console.print(table("validation errors", ["line", "code", "message"], rows))


@files_app.command("upload")
@client_command
def files_upload(
    client: Tunefleet,
    json_out: bool,
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL file.")],
    purpose: Annotated[str, typer.Option(help="File purpose.")] = "fine-tune",
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for validation.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for validation.")] = 300.0,
) -> None:
    """Upload a training file and show its validation result (line-numbered errors)."""
    if not json_out:
        console.print(Text(f"uploading {path.name} ({fmt_bytes(path.stat().st_size)}) ..."))
    f = client.files.upload(path, purpose=purpose, wait=wait, timeout=timeout)
    if json_out:
        print_json(f)
    else:
        print_file(f)
    if f.status == "error":
        raise typer.Exit(EXIT_JOB_FAILED)


@files_app.command("list")
@client_command
def files_list(
    client: Tunefleet,
    json_out: bool,
    purpose: Annotated[str | None, typer.Option(help="Only files of this purpose.")] = None,
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
) -> None:
    """List uploaded files, newest first."""
    items, has_more = page_items(client.files.list(purpose=purpose, limit=limit, after=after), fetch_all)
    rows = ((f.id, f.filename, fmt_bytes(f.bytes), status_text(f.status), fmt_time(f.created_at)) for f in items)
    print_list(json_out, items, "files", ["id", "filename", "size", "status", "created"], rows,
               has_more=has_more, show_next_cursor=True)


@files_app.command("get")
@client_command
def files_get(client: Tunefleet, json_out: bool, file_id: str) -> None:
    """Show one file with its validation result."""
    f = client.files.retrieve(file_id)
    print_json(f) if json_out else print_file(f)


@files_app.command("content")
def files_content(
    file_id: str,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to this file.")] = None,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Print (or save) a file's content."""
    # Raw bytes go to stdout (or the file), so this command has no --json.
    with connected(False, base_url, api_key) as client:
        data = client.files.content(file_id)
        if output:
            output.write_bytes(data)
        else:
            typer.echo(data.decode("utf-8", errors="replace"), nl=False)


@files_app.command("delete")
@client_command
def files_delete(client: Tunefleet, json_out: bool, file_id: str) -> None:
    """Delete a file (refused while a live job uses it)."""
    result = client.files.delete(file_id)
    print_json(result) if json_out else console.print(f"deleted {result.id}")
