"""Client commands of the `tunefleet` CLI: files, jobs, estimate, pools, models, webhooks, login.

Every command talks to the service through the SDK (``tunefleet.Tunefleet``) and takes
``--json`` for scripts, plus ``--base-url`` / ``--api-key`` (else ``TUNEFLEET_BASE_URL`` /
``TUNEFLEET_API_KEY``, else the config file written by ``tunefleet login``).

Exit codes: 0 ok; 1 the service answered an error or could not be reached; 2 usage
error; 3 the job (``watch``/``--wait``) ended failed or cancelled, or a file failed
validation; 4 a wait timed out.
"""

# No `from __future__ import annotations`: typer reads these annotations at runtime, and
# the job-option factory below builds some of them from local variables.

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from tunefleet.cli import app
from tunefleet.cli.render import (
    JsonOpt,
    console,
    fmt_bytes,
    fmt_time,
    key_values,
    print_json,
    report_error,
    status_text,
    table,
)
from tunefleet.cli.watch import watch_job
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.config import config_path, normalize_base_url, write_config_file
from tunefleet.sdk.errors import APIStatusError, TunefleetError, WaitTimeoutError
from tunefleet.sdk.types import FileObject, FineTuningJob

EXIT_API_ERROR = 1
EXIT_JOB_FAILED = 3
EXIT_TIMEOUT = 4

files_app = typer.Typer(help="Upload and inspect training files.", no_args_is_help=True)
jobs_app = typer.Typer(help="Create, follow and control fine-tuning jobs.", no_args_is_help=True)
webhooks_app = typer.Typer(help="Signed webhook endpoints for job events.", no_args_is_help=True)
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")
app.add_typer(webhooks_app, name="webhooks")

BaseUrlOpt = Annotated[
    str | None, typer.Option("--base-url", help="Service URL (default: env, config, http://127.0.0.1:8000).")
]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="API key (default: env or config).")]
LimitOpt = Annotated[int, typer.Option("--limit", min=1, max=100, help="Items per page.")]
AfterOpt = Annotated[str | None, typer.Option("--after", help="Cursor: the last id of the previous page.")]
AllOpt = Annotated[bool, typer.Option("--all", help="Follow the cursor through every page.")]


def _client(base_url: str | None, api_key: str | None) -> Tunefleet:
    return Tunefleet(base_url=base_url, api_key=api_key)


@contextlib.contextmanager
def _errors(json_out: bool) -> Iterator[None]:
    """Turn SDK errors into a message (or JSON on stderr) and a stable exit code."""
    try:
        yield
    except WaitTimeoutError as exc:
        report_error({"message": exc.message, "code": "wait_timeout"}, json_out)
        raise typer.Exit(EXIT_TIMEOUT) from None
    except APIStatusError as exc:
        report_error(
            {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code, "status": exc.status},
            json_out,
        )
        raise typer.Exit(EXIT_API_ERROR) from None
    except TunefleetError as exc:
        report_error({"message": str(exc), "code": type(exc).__name__}, json_out)
        raise typer.Exit(EXIT_API_ERROR) from None


def _list_out(page: Any, fetch_all: bool) -> tuple[list[Any], bool]:
    if fetch_all:
        return list(page), False
    return page.data, page.has_more


# ---------------------------------------------------------------------------- files


def _print_file(f: FileObject) -> None:
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
def files_upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL file.")],
    purpose: Annotated[str, typer.Option(help="File purpose.")] = "fine-tune",
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for validation.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for validation.")] = 300.0,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Upload a training file and show its validation result (line-numbered errors)."""
    with _errors(json_out), _client(base_url, api_key) as client:
        if not json_out:
            console.print(Text(f"uploading {path.name} ({fmt_bytes(path.stat().st_size)}) ..."))
        f = client.files.upload(path, purpose=purpose, wait=wait, timeout=timeout)
        if json_out:
            print_json(f)
        else:
            _print_file(f)
        if f.status == "error":
            raise typer.Exit(EXIT_JOB_FAILED)


@files_app.command("list")
def files_list(
    purpose: Annotated[str | None, typer.Option(help="Only files of this purpose.")] = None,
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List uploaded files, newest first."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items, has_more = _list_out(client.files.list(purpose=purpose, limit=limit, after=after), fetch_all)
        if json_out:
            print_json({"object": "list", "data": items, "has_more": has_more})
            return
        rows = [(f.id, f.filename, fmt_bytes(f.bytes), status_text(f.status), fmt_time(f.created_at)) for f in items]
        console.print(table("files", ["id", "filename", "size", "status", "created"], rows))
        if has_more:
            console.print(f"more: --after {items[-1].id}")


@files_app.command("get")
def files_get(
    file_id: str,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Show one file with its validation result."""
    with _errors(json_out), _client(base_url, api_key) as client:
        f = client.files.retrieve(file_id)
        print_json(f) if json_out else _print_file(f)


@files_app.command("content")
def files_content(
    file_id: str,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to this file.")] = None,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Print (or save) a file's content."""
    with _errors(False), _client(base_url, api_key) as client:
        data = client.files.content(file_id)
        if output:
            output.write_bytes(data)
        else:
            typer.echo(data.decode("utf-8", errors="replace"), nl=False)


@files_app.command("delete")
def files_delete(
    file_id: str,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Delete a file (refused while a live job uses it)."""
    with _errors(json_out), _client(base_url, api_key) as client:
        result = client.files.delete(file_id)
        print_json(result) if json_out else console.print(f"deleted {result.id}")


# ----------------------------------------------------------------------------- jobs


def _parse_kv(values: list[str] | None, option: str) -> dict[str, str]:
    out = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        out[key] = value
    return out


def _job_fields(
    *, body: Path | None, validation_file: str | None, suffix: str | None, seed: int | None,
    n_epochs: str | None, batch_size: str | None, learning_rate: str | None, method: str | None, r: int | None,
    alpha: float | None, quantization: str | None, target_modules: str | None, trainer: str | None,
    pool: str | None, gpus: int | None, priority: str | None, max_seq_len: int | None, packing: bool | None,
    metadata: list[str] | None, wandb_project: str | None, mlflow_uri: str | None,
) -> dict[str, Any]:
    """Map CLI options onto the create body; options override the ``--body`` JSON file."""
    fields: dict[str, Any] = {}
    if body is not None:
        try:
            fields = json.loads(body.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"cannot read JSON body: {exc}", param_hint="--body") from None
        if not isinstance(fields, dict):
            raise typer.BadParameter("the body must be a JSON object", param_hint="--body")

    def num(value: str | None) -> Any:
        if value is None or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            return float(value)

    hp = {k: num(v) for k, v in {"n_epochs": n_epochs, "batch_size": batch_size,
                                  "learning_rate": learning_rate}.items()
          if v is not None}
    if hp:
        fields["hyperparameters"] = {**fields.get("hyperparameters", {}), **hp}
    adapter = {k: v for k, v in {"method": method, "r": r, "alpha": alpha, "quantization": quantization}.items()
               if v is not None}
    if target_modules:
        adapter["target_modules"] = [m.strip() for m in target_modules.split(",") if m.strip()]
    if adapter:
        fields["adapter"] = {**fields.get("adapter", {}), **adapter}
    placement = {k: v for k, v in {"pool": pool, "gpus": gpus}.items() if v is not None}
    if placement:
        fields["placement"] = {**fields.get("placement", {}), **placement}
    integrations = list(fields.get("integrations", []))
    if wandb_project:
        integrations.append({"type": "wandb", "wandb": {"project": wandb_project}})
    if mlflow_uri:
        integrations.append({"type": "mlflow", "mlflow": {"tracking_uri": mlflow_uri}})
    if integrations:
        fields["integrations"] = integrations
    meta = _parse_kv(metadata, "--metadata")
    if meta:
        fields["metadata"] = {**fields.get("metadata", {}), **meta}
    simple = {"validation_file": validation_file, "suffix": suffix, "seed": seed, "trainer": trainer,
              "max_seq_len": max_seq_len, "packing": packing,
              "priority": int(priority) if priority and priority.lstrip("-").isdigit() else priority}
    fields.update({k: v for k, v in simple.items() if v is not None})
    return fields


def _resolve_training_file(client: Tunefleet, value: str, json_out: bool) -> str:
    """A local path is uploaded (and validated) first; anything else is a file id."""
    path = Path(value)
    if not path.is_file():
        return value
    if not json_out:
        console.print(Text(f"uploading {path.name} ..."))
    f = client.files.upload(path, wait=True)
    if f.status == "error":
        if not json_out:
            _print_file(f)
        raise typer.Exit(EXIT_JOB_FAILED)
    return f.id


def _print_job(job: FineTuningJob) -> None:
    extra = job.model_extra or {}
    pairs = [
        ("id", job.id), ("status", status_text(job.status)), ("model", job.model),
        ("training file", job.training_file), ("validation file", job.validation_file),
        ("created", fmt_time(job.created_at)), ("finished", fmt_time(job.finished_at) if job.finished_at else None),
        ("fine-tuned model", job.fine_tuned_model), ("trained tokens", job.trained_tokens),
        ("estimated finish", fmt_time(job.estimated_finish) if job.estimated_finish else None),
        ("hyperparameters", job.hyperparameters),
    ]
    for key in ("trainer", "adapter", "placement", "priority", "status_reason", "pool"):
        if extra.get(key) is not None:
            pairs.append((key, extra[key]))
    if job.error and (job.error.message or job.error.code):
        pairs.append(("error", f"[{job.error.code}] {job.error.message}"))
    if job.metadata:
        pairs.append(("metadata", job.metadata))
    console.print(key_values(f"job {job.id}", pairs))


def _make_job_command(estimate: bool) -> Any:
    """`jobs create` and `estimate` take the same body options; build both from one list."""
    create_only = {"hidden": estimate}

    def command(
        model: Annotated[str, typer.Option("--model", "-m", help="Base model id (see `tunefleet models`).")],
        training_file: Annotated[str, typer.Option("--training-file", "-t",
                                                   help="File id, or a local JSONL path to upload first.")],
        validation_file: Annotated[str | None, typer.Option(help="Validation file id.")] = None,
        body: Annotated[Path | None, typer.Option(help="JSON file with more body fields.")] = None,
        suffix: Annotated[str | None, typer.Option(help="Suffix of the fine-tuned model name.")] = None,
        seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
        n_epochs: Annotated[str | None, typer.Option(help="Epochs or 'auto'.")] = None,
        batch_size: Annotated[str | None, typer.Option(help="Batch size or 'auto'.")] = None,
        learning_rate: Annotated[str | None, typer.Option(help="Learning rate.")] = None,
        method: Annotated[str | None, typer.Option(help="Adapter method: lora or qlora.")] = None,
        r: Annotated[int | None, typer.Option("--r", help="LoRA rank.")] = None,
        alpha: Annotated[float | None, typer.Option(help="LoRA alpha.")] = None,
        quantization: Annotated[str | None, typer.Option(help="QLoRA quantization: nf4 or hqq4.")] = None,
        target_modules: Annotated[str | None, typer.Option(help="Comma-separated, e.g. q_proj,v_proj.")] = None,
        trainer: Annotated[str | None, typer.Option(help="auto, jax or fsdp_qlora.")] = None,
        pool: Annotated[str | None, typer.Option(help="Node pool to place the job on.")] = None,
        gpus: Annotated[int | None, typer.Option(help="Number of GPUs.")] = None,
        priority: Annotated[str | None, typer.Option(help="Scheduling priority.")] = None,
        max_seq_len: Annotated[int | None, typer.Option(help="Maximum sequence length.")] = None,
        packing: Annotated[bool | None, typer.Option("--packing/--no-packing", help="Pack sequences.")] = None,
        metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
        wandb_project: Annotated[str | None, typer.Option(help="Mirror to this W&B project.")] = None,
        mlflow_uri: Annotated[str | None, typer.Option(help="Mirror to this MLflow tracking URI.")] = None,
        idempotency_key: Annotated[str | None, typer.Option(help="Reuse to make retries safe.",
                                                               **create_only)] = None,
        watch: Annotated[bool, typer.Option("--watch", help="Follow the job live after creating it.",
                                            **create_only)] = False,
        json_out: JsonOpt = False,
        base_url: BaseUrlOpt = None,
        api_key: ApiKeyOpt = None,
    ) -> None:
        fields = _job_fields(
            body=body, validation_file=validation_file, suffix=suffix, seed=seed, n_epochs=n_epochs,
            batch_size=batch_size, learning_rate=learning_rate, method=method, r=r, alpha=alpha,
            quantization=quantization, target_modules=target_modules, trainer=trainer, pool=pool, gpus=gpus,
            priority=priority, max_seq_len=max_seq_len, packing=packing, metadata=metadata,
            wandb_project=wandb_project, mlflow_uri=mlflow_uri,
        )
        with _errors(json_out), _client(base_url, api_key) as client:
            file_id = _resolve_training_file(client, training_file, json_out)
            if estimate:
                result = client.jobs.estimate(model=model, training_file=file_id, extra_body=fields)
                if json_out:
                    print_json(result)
                else:
                    _print_estimate(result.to_dict())
                return
            job = client.jobs.create(model=model, training_file=file_id, idempotency_key=idempotency_key,
                                     extra_body=fields)
            if json_out and not watch:
                print_json(job)
            elif not json_out:
                _print_job(job)
            if watch:
                final = watch_job(client, job.id, json_lines=json_out, console=console)
                if final.status != "succeeded":
                    raise typer.Exit(EXIT_JOB_FAILED)

    command.__doc__ = (
        "Estimate memory per GPU, pool, GPU count, tokens/s, ETA and cost of a job (a dry run)."
        if estimate else "Create a fine-tuning job (uploads a local training file first)."
    )
    return command


jobs_app.command("create")(_make_job_command(estimate=False))
app.command("estimate")(_make_job_command(estimate=True))


def _print_estimate(est: dict[str, Any]) -> None:
    scalar = [(k, v) for k, v in est.items() if not isinstance(v, (dict, list)) and k != "object"]
    nested = [(k, v) for k, v in est.items() if isinstance(v, dict)]
    console.print(key_values("estimate", scalar + nested))
    for key, value in est.items():
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            console.print(f"[bold]{key}[/bold]")
            for line in value:
                console.print(Text(f"  - {line}"))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for row in value for k in row))
            console.print(table(key, columns, [[_cell(row.get(c)) for c in columns] for row in value]))


def _cell(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


@jobs_app.command("list")
def jobs_list(
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
    status: Annotated[str | None, typer.Option(help="Only jobs in this status.")] = None,
    metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE filter, repeatable.")] = None,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List jobs, newest first."""
    meta = _parse_kv(metadata, "--metadata")
    with _errors(json_out), _client(base_url, api_key) as client:
        page = client.jobs.list(limit=limit, after=after, status=status, metadata=meta or None)
        items, has_more = _list_out(page, fetch_all)
        if json_out:
            print_json({"object": "list", "data": items, "has_more": has_more})
            return
        rows = [(j.id, status_text(j.status), j.model, j.fine_tuned_model, fmt_time(j.created_at)) for j in items]
        console.print(table("jobs", ["id", "status", "model", "fine-tuned model", "created"], rows))
        if has_more:
            console.print(f"more: --after {items[-1].id}")


@jobs_app.command("get")
def jobs_get(job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None) -> None:
    """Show one job."""
    with _errors(json_out), _client(base_url, api_key) as client:
        job = client.jobs.retrieve(job_id)
        print_json(job) if json_out else _print_job(job)


def _control(action: str, job_id: str, json_out: bool, base_url: str | None, api_key: str | None) -> None:
    with _errors(json_out), _client(base_url, api_key) as client:
        job = getattr(client.jobs, action)(job_id)
        if json_out:
            print_json(job)
        else:
            console.print(Text.assemble(f"{job.id}: ", status_text(job.status)))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None,
                api_key: ApiKeyOpt = None) -> None:
    """Cancel a job (a running trainer checkpoints and stops)."""
    _control("cancel", job_id, json_out, base_url, api_key)


@jobs_app.command("pause")
def jobs_pause(job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None,
               api_key: ApiKeyOpt = None) -> None:
    """Pause a job; it keeps its last checkpoint and frees its GPUs."""
    _control("pause", job_id, json_out, base_url, api_key)


@jobs_app.command("resume")
def jobs_resume(job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None,
                api_key: ApiKeyOpt = None) -> None:
    """Resume a paused job from its last checkpoint."""
    _control("resume", job_id, json_out, base_url, api_key)


@jobs_app.command("watch")
def jobs_watch(
    job_id: str,
    poll_interval: Annotated[float, typer.Option(help="Seconds between polls when streaming is unavailable.")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print stream messages as JSON lines.")] = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Follow a job live: progress bar with steps, tokens/s, loss and ETA; events as they come."""
    with _errors(json_out), _client(base_url, api_key) as client:
        final = watch_job(client, job_id, json_lines=json_out, poll_interval=poll_interval, console=console)
    if final.status != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@jobs_app.command("wait")
def jobs_wait(
    job_id: str,
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Block until the job ends; exit 0 if it succeeded, 3 otherwise, 4 on timeout."""
    with _errors(json_out), _client(base_url, api_key) as client:
        job = client.jobs.wait(job_id, timeout=timeout)
        print_json(job) if json_out else console.print(Text.assemble(f"{job.id}: ", status_text(job.status)))
    if job.status != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@jobs_app.command("events")
def jobs_events(
    job_id: str,
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List a job's events, newest first."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items, has_more = _list_out(client.jobs.list_events(job_id, limit=limit, after=after), fetch_all)
        if json_out:
            print_json({"object": "list", "data": items, "has_more": has_more})
            return
        rows = [(fmt_time(e.created_at), e.level, e.message) for e in items]
        console.print(table(f"events of {job_id}", ["time", "level", "message"], rows))


@jobs_app.command("checkpoints")
def jobs_checkpoints(
    job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None
) -> None:
    """List a job's checkpoints with their metrics."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items = list(client.jobs.list_checkpoints(job_id))
        if json_out:
            print_json({"object": "list", "data": items, "has_more": False})
            return
        rows = [(c.id, c.step_number, _cell((c.metrics or {}).get("train_loss")),
                 _cell((c.metrics or {}).get("valid_loss")), fmt_time(c.created_at)) for c in items]
        console.print(table(f"checkpoints of {job_id}", ["id", "step", "train loss", "valid loss", "created"], rows))


@jobs_app.command("metrics")
def jobs_metrics(
    job_id: str, json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None
) -> None:
    """Print a job's training metrics (every step)."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items = list(client.jobs.metrics(job_id))
        if json_out:
            print_json({"object": "list", "data": items, "has_more": False})
            return
        rows = [(m.step, m.total_steps, _cell(m.train_loss), _cell(m.valid_loss), _cell(m.learning_rate),
                 _cell(m.tokens_per_s)) for m in items]
        console.print(table(f"metrics of {job_id}", ["step", "of", "loss", "valid loss", "lr", "tok/s"], rows))


@jobs_app.command("logs")
def jobs_logs(
    job_id: str,
    tail: Annotated[int | None, typer.Option(min=1, help="Only the last N lines.")] = None,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Print the trainer's log (the last --tail lines; the service's default is 200)."""
    with _errors(json_out), _client(base_url, api_key) as client:
        text = client.jobs.logs(job_id, tail=tail)
    lines = text.splitlines()
    if json_out:
        print_json({"job_id": job_id, "lines": lines})
    else:
        for line in lines:
            typer.echo(line)


@jobs_app.command("download")
def jobs_download(
    job_id: str,
    dest: Annotated[Path, typer.Option("--dest", "-o", help="Directory to write the artifacts into.")] = Path("."),
    prefix: Annotated[str, typer.Option(help="Only artifacts under this prefix, e.g. 'adapter/'.")] = "",
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Download a job's artifacts (adapter, config, metrics), each checked against its sha256."""
    with _errors(json_out), _client(base_url, api_key) as client:
        artifacts = [a for a in client.jobs.list_artifacts(job_id) if a.name.startswith(prefix)]
        paths = client.jobs.download(job_id, dest, prefix=prefix)
    if json_out:
        print_json({"job_id": job_id, "files": [
            {"name": a.name, "path": str(p), "bytes": a.bytes, "sha256": a.sha256} for a, p in zip(artifacts, paths)
        ]})
    else:
        rows = [(a.name, fmt_bytes(a.bytes), (a.sha256 or "")[:16], str(p)) for a, p in zip(artifacts, paths)]
        console.print(table(f"downloaded {len(paths)} file(s), sha256 verified", ["name", "size", "sha256", "path"],
                            rows))


# ------------------------------------------------------------- pools, models, login


@app.command("pools")
def pools(json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None) -> None:
    """Node pools with their capacity and usage."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items = client.node_pools.list()
    if json_out:
        print_json({"object": "list", "data": items})
        return
    known = ["name", "accelerator", "trainer", "gpu_memory_gb", "gpus_total", "gpus_used", "gpus_free",
             "running_jobs", "queued_jobs", "price_per_gpu_hour"]
    present = [k for k in known if any(k in p.to_dict() for p in items)] or ["name"]
    rows = [[_cell(p.to_dict().get(k)) for k in present] for p in items]
    console.print(table("node pools", present, rows))


@app.command("models")
def models(json_out: JsonOpt = False, base_url: BaseUrlOpt = None, api_key: ApiKeyOpt = None) -> None:
    """Base models and fine-tuned adapters you can use."""
    with _errors(json_out), _client(base_url, api_key) as client:
        items = list(client.models.list())
    if json_out:
        print_json({"object": "list", "data": items})
        return
    rows = [(m.id, m.owned_by, fmt_time(m.created)) for m in items]
    console.print(table("models", ["id", "owned by", "created"], rows))


@app.command("login")
def login(
    base_url: Annotated[str, typer.Option("--base-url", prompt="Service URL", help="Service URL.")],
    api_key: Annotated[str, typer.Option("--api-key", prompt="API key", hide_input=True, help="API key.")],
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the key first.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Save the service URL and API key to the config file (mode 0600)."""
    with _errors(json_out):
        url = normalize_base_url(base_url)
        if verify:
            with Tunefleet(base_url=url, api_key=api_key, max_retries=1) as client:
                client.jobs.list(limit=1)
        path = write_config_file({"base_url": url, "api_key": api_key})
    if json_out:
        print_json({"config": str(path), "base_url": url})
    else:
        console.print(Text(f"saved {url} to {path}"))


@app.command("config")
def show_config(json_out: JsonOpt = False) -> None:
    """Show where the CLI finds its URL and key (the key is masked)."""
    from tunefleet.sdk.config import resolve_config

    with _errors(json_out):
        cfg = resolve_config()
    masked = None if not cfg.api_key else cfg.api_key[:12] + "..."
    out = {"config_file": str(config_path()), "base_url": cfg.base_url, "api_key": masked}
    print_json(out) if json_out else console.print(key_values("config", list(out.items())))


from tunefleet.cli import webhooks as _webhooks  # noqa: F401  (registers `tunefleet webhooks ...`)
