"""`tunefleet jobs ...` and `tunefleet estimate`: create, follow and control fine-tuning jobs.

``jobs create`` and ``estimate`` take the same body options (built once, by
``_make_job_command``); a local path given as the training file is uploaded and validated
first. ``jobs watch`` (and ``create --watch``) draw the live view of ``tunefleet.cli.watch``.
``jobs evaluate`` starts a held-out evaluation of a succeeded job (base against
fine-tuned) and waits for it; ``jobs evaluations`` lists them.
"""

# No `from __future__ import annotations`: typer reads these annotations at runtime, and
# the job-option factory below builds some of them from local variables.

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from tunefleet.cli.files import print_file
from tunefleet.cli.options import (
    EXIT_JOB_FAILED,
    AfterOpt,
    AllOpt,
    ApiKeyOpt,
    BaseUrlOpt,
    JsonOpt,
    LimitOpt,
    client_command,
    connected,
    page_items,
)
from tunefleet.cli.render import (
    console,
    field_label,
    fmt_bytes,
    fmt_field,
    fmt_time,
    fmt_value,
    key_values,
    print_json,
    print_list,
    status_text,
    table,
)
from tunefleet.cli.watch import watch_job
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.types import Evaluation, FineTuningJob, JobMetric

jobs_app = typer.Typer(help="Create, follow and control fine-tuning jobs.", no_args_is_help=True)


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
    n_epochs: str | None, batch_size: str | None, learning_rate: str | None,
    learning_rate_multiplier: str | None, training_method: str | None, beta: str | None, method: str | None,
    r: int | None,
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

    hp = {k: num(v) for k, v in {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate": learning_rate,
                                  "learning_rate_multiplier": learning_rate_multiplier, "beta": beta}.items()
          if v is not None}
    _place_method(fields, training_method, hp)
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


# The methods a flag can choose; a reinforcement job needs its grader object (--body).
CLI_METHODS = ("supervised", "dpo")


def _place_method(fields: dict[str, Any], training_method: str | None, hp: dict[str, Any]) -> None:
    """Put the method and the hyperparameter options where the API takes them.

    With a method (``--training-method`` or the ``--body``'s ``method.type``) they go into
    ``method.<type>.hyperparameters``, as OpenAI's API takes them (a DPO job takes them only
    there); without one, into the top-level ``hyperparameters`` of a supervised job.
    """
    if training_method not in (None, *CLI_METHODS):
        raise typer.BadParameter(f"{training_method!r} is not one of {', '.join(CLI_METHODS)} (a reinforcement "
                                 "job's grader goes in --body)", param_hint="--training-method")
    given = fields.get("method")
    kind = training_method or (given.get("type") if isinstance(given, dict) else None)
    if training_method is not None and isinstance(given, dict) and given.get("type") not in (None, training_method):
        raise typer.BadParameter(f"the body's method is {given.get('type')!r}", param_hint="--training-method")
    if "beta" in hp and kind != "dpo":
        raise typer.BadParameter("beta is a DPO hyperparameter: add --training-method dpo", param_hint="--beta")
    if kind is None:
        if hp:
            fields["hyperparameters"] = {**fields.get("hyperparameters", {}), **hp}
        return
    method = dict(given) if isinstance(given, dict) else {}
    settings = dict(method.get(kind) or {})
    if hp:
        settings["hyperparameters"] = {**settings.get("hyperparameters", {}), **hp}
    method["type"] = kind
    if settings or kind != "supervised":
        method[kind] = settings
    fields["method"] = method


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
            print_file(f)
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
        learning_rate_multiplier: Annotated[str | None, typer.Option(
            help="Learning-rate multiplier or 'auto' (OpenAI's; scales the base model's default).")] = None,
        training_method: Annotated[str | None, typer.Option(
            help="supervised (the default) or dpo, with a preference file. A reinforcement job needs "
                 "its grader: give the method in --body.")] = None,
        beta: Annotated[str | None, typer.Option(help="DPO's beta or 'auto' (with --training-method dpo).")] = None,
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
            batch_size=batch_size, learning_rate=learning_rate, learning_rate_multiplier=learning_rate_multiplier,
            training_method=training_method, beta=beta, method=method, r=r, alpha=alpha,
            quantization=quantization, target_modules=target_modules, trainer=trainer, pool=pool, gpus=gpus,
            priority=priority, max_seq_len=max_seq_len, packing=packing, metadata=metadata,
            wandb_project=wandb_project, mlflow_uri=mlflow_uri,
        )
        with connected(json_out, base_url, api_key) as client:
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


jobs_create = jobs_app.command("create")(_make_job_command(estimate=False))
# A top-level command (`tunefleet estimate`), registered on the root app.
estimate = _make_job_command(estimate=True)


# Objects of the estimate whose numbers are all bytes (``MemoryBreakdownPublic``).
_BYTE_OBJECTS = frozenset({"breakdown"})


def _estimate_pairs(obj: dict[str, Any]) -> list[tuple[str, str]]:
    return [(field_label(k), fmt_field(k, v, unit="bytes" if k in _BYTE_OBJECTS else None))
            for k, v in obj.items() if k != "object"]


def _print_estimate(est: dict[str, Any]) -> None:
    """The estimate for people: its fields (sizes in GiB/MiB, times in h/m/s, objects as
    key=value lines), where the job goes (``chosen``), then a table per list of objects
    (``pools``, ``unfit``) and the ``reasons`` and ``notes`` one per line."""
    tables = {k: v for k, v in est.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)}
    texts = {k: v for k, v in est.items() if isinstance(v, list) and v and k not in tables}
    chosen = est.get("chosen")
    fields = {k: v for k, v in est.items() if k not in tables and k not in texts and k != "chosen"
              and not (isinstance(v, list) and not v)}
    console.print(key_values("estimate", _estimate_pairs(fields)))
    if isinstance(chosen, dict):
        console.print(key_values("chosen", _estimate_pairs(chosen)))
    for key, rows in tables.items():
        columns = list(dict.fromkeys(k for row in rows for k in row))
        console.print(table(key, [field_label(c) for c in columns],
                            [[fmt_field(c, row.get(c), unit="bytes" if c in _BYTE_OBJECTS else None)
                              for c in columns] for row in rows]))
    for key, lines in texts.items():
        console.print(f"[bold]{key}[/bold]")
        for line in lines:
            console.print(Text(f"  - {fmt_value(line)}"))


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
    with connected(json_out, base_url, api_key) as client:
        page = client.jobs.list(limit=limit, after=after, status=status, metadata=meta or None)
        items, has_more = page_items(page, fetch_all)
        rows = ((j.id, status_text(j.status), j.model, j.fine_tuned_model, fmt_time(j.created_at)) for j in items)
        print_list(json_out, items, "jobs", ["id", "status", "model", "fine-tuned model", "created"], rows,
                   has_more=has_more, show_next_cursor=True)


@jobs_app.command("get")
@client_command
def jobs_get(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """Show one job."""
    job = client.jobs.retrieve(job_id)
    print_json(job) if json_out else _print_job(job)


def _print_status(job: FineTuningJob, json_out: bool) -> None:
    if json_out:
        print_json(job)
    else:
        console.print(Text.assemble(f"{job.id}: ", status_text(job.status)))


@jobs_app.command("cancel")
@client_command
def jobs_cancel(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """Cancel a job (a running trainer checkpoints and stops)."""
    _print_status(client.jobs.cancel(job_id), json_out)


@jobs_app.command("pause")
@client_command
def jobs_pause(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """Pause a job; it keeps its last checkpoint and frees its GPUs."""
    _print_status(client.jobs.pause(job_id), json_out)


@jobs_app.command("resume")
@client_command
def jobs_resume(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """Resume a paused job from its last checkpoint."""
    _print_status(client.jobs.resume(job_id), json_out)


@jobs_app.command("watch")
def jobs_watch(
    job_id: str,
    poll_interval: Annotated[float, typer.Option(help="Seconds between polls when streaming is unavailable.")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print stream messages as JSON lines.")] = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Follow a job live: progress bar with steps, tokens/s, loss and ETA; events as they come."""
    with connected(json_out, base_url, api_key) as client:
        final = watch_job(client, job_id, json_lines=json_out, poll_interval=poll_interval, console=console)
    if final.status != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@jobs_app.command("wait")
@client_command
def jobs_wait(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None,
) -> None:
    """Block until the job ends; exit 0 if it succeeded, 3 otherwise, 4 on timeout."""
    job = client.jobs.wait(job_id, timeout=timeout)
    _print_status(job, json_out)
    if job.status != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


@jobs_app.command("events")
@client_command
def jobs_events(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
) -> None:
    """List a job's events, newest first."""
    items, has_more = page_items(client.jobs.list_events(job_id, limit=limit, after=after), fetch_all)
    rows = ((fmt_time(e.created_at), e.level, e.message) for e in items)
    print_list(json_out, items, f"events of {job_id}", ["time", "level", "message"], rows, has_more=has_more)


@jobs_app.command("checkpoints")
@client_command
def jobs_checkpoints(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """List a job's checkpoints with their metrics."""
    items = list(client.jobs.list_checkpoints(job_id))
    rows = ((c.id, c.step_number, fmt_value((c.metrics or {}).get("train_loss")),
             fmt_value((c.metrics or {}).get("valid_loss")), fmt_time(c.created_at)) for c in items)
    print_list(json_out, items, f"checkpoints of {job_id}", ["id", "step", "train loss", "valid loss", "created"],
               rows, has_more=False)


@jobs_app.command("metrics")
@client_command
def jobs_metrics(client: Tunefleet, json_out: bool, job_id: str) -> None:
    """Print a job's training metrics (every step)."""
    items = list(client.jobs.metrics(job_id))
    rewards = [(label, name) for label, name in REWARD_COLUMNS if any(_reward(m, name) is not None for m in items)]
    rows = ((m.step, m.total_steps, fmt_value(m.train_loss), fmt_value(m.valid_loss), fmt_value(m.learning_rate),
             fmt_value(m.tokens_per_s), *(fmt_value(_reward(m, name)) for _, name in rewards)) for m in items)
    columns = ["step", "of", "loss", "valid loss", "lr", "tok/s", *(label for label, _ in rewards)]
    print_list(json_out, items, f"metrics of {job_id}", columns, rows, has_more=False)


# A DPO run's reward metrics (the API's names, ``rewards/...``): a column each when some row has it.
REWARD_COLUMNS = [
    ("reward acc", "rewards/accuracy"), ("reward margin", "rewards/margin"),
    ("chosen", "rewards/chosen"), ("rejected", "rewards/rejected"),
    ("valid reward acc", "valid_rewards/accuracy"), ("valid reward margin", "valid_rewards/margin"),
]


def _reward(metric: JobMetric, name: str) -> Any:
    """A reward metric of a row: the API's ``rewards/margin``, or ``rewards_margin`` as the
    service stores it (an older or other service may answer under that name)."""
    extra = metric.model_extra or {}
    value = extra.get(name)
    return extra.get(name.replace("/", "_")) if value is None else value


@jobs_app.command("logs")
@client_command
def jobs_logs(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    tail: Annotated[int | None, typer.Option(min=1, help="Only the last N lines.")] = None,
) -> None:
    """Print the trainer's log (the last --tail lines; the service's default is 200)."""
    lines = client.jobs.logs(job_id, tail=tail).splitlines()
    if json_out:
        print_json({"job_id": job_id, "lines": lines})
    else:
        for line in lines:
            typer.echo(line)


@jobs_app.command("download")
@client_command
def jobs_download(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    dest: Annotated[Path, typer.Option("--dest", "-o", help="Directory to write the artifacts into.")] = Path("."),
    prefix: Annotated[str, typer.Option(help="Only artifacts under this prefix, e.g. 'adapter/'.")] = "",
) -> None:
    """Download a job's artifacts (adapter, config, metrics), each checked against its sha256."""
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


def _score(evaluation: Evaluation, key: str) -> str:
    """A model's mean score: a percentage for graders whose rewards are fractions."""
    result = (evaluation.results or {}).get(key)
    if result is None:
        return "-"
    if (evaluation.grader or {}).get("type") in ("string_check", "text_similarity"):
        return f"{100 * result.score:.1f}".removesuffix(".0") + "%"
    return f"{result.score:.3f}"


def _grader_label(evaluation: Evaluation) -> str:
    grader = evaluation.grader or {}
    if grader.get("type") == "string_check" and grader.get("name") == "exact_match":
        return "exact match"
    return str(grader.get("name") or grader.get("type") or "-")


def _rows(evaluation: Evaluation) -> Any:
    result = (evaluation.results or {}).get("fine_tuned")
    return result.count if result is not None else evaluation.max_samples


def _print_evaluation(evaluation: Evaluation) -> None:
    console.print(Text.assemble(f"{evaluation.id}: ", status_text(evaluation.status)))
    if evaluation.error is not None:
        console.print(Text(f"{evaluation.error.code}: {evaluation.error.message}"))
    if evaluation.results:
        console.print(Text(f"held-out {_grader_label(evaluation)} on {_rows(evaluation)} rows of {evaluation.file}: "
                           f"base {_score(evaluation, 'base')} -> fine-tuned {_score(evaluation, 'fine_tuned')}"))
    if evaluation.samples:
        rows = ((s.get("prompt"), s.get("reference"), (s.get("base") or {}).get("answer"),
                 (s.get("fine_tuned") or {}).get("answer")) for s in evaluation.samples)
        console.print(table("sample answers", ["prompt", "reference", "base", "fine-tuned"], rows))


@jobs_app.command("evaluate")
@client_command
def jobs_evaluate(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    file: Annotated[str | None, typer.Option(
        "--file", help="The held-out rows: a file id, or a local JSONL file (uploaded first); default: the job's "
                       "validation file.")] = None,
    max_samples: Annotated[int | None, typer.Option(min=1, help="Evaluate the first N rows (default: all, up to "
                                                                  "the service's limit).")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Longest answer in tokens (default 64).")] = None,
    grader: Annotated[str | None, typer.Option(
        help="A grader as JSON, or @path to a JSON file (default: exact match with the row's last answer).")] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the result.")] = True,
    timeout: Annotated[float | None, typer.Option(help="Give up waiting after this many seconds.")] = None,
) -> None:
    """Evaluate a succeeded job's base and fine-tuned models on held-out rows; exit 3 if the evaluation fails."""
    grader_json = None
    if grader is not None:
        text = Path(grader[1:]).read_text() if grader.startswith("@") else grader
        try:
            grader_json = json.loads(text)
        except ValueError as exc:
            raise typer.BadParameter(f"not JSON: {exc}", param_hint="--grader") from exc
    file_id = _resolve_training_file(client, file, json_out) if file is not None else None
    evaluation = client.jobs.evaluate(job_id, file=file_id, max_samples=max_samples, max_tokens=max_tokens,
                                      grader=grader_json)
    if wait:
        if not json_out:
            console.print(Text(f"{evaluation.id}: evaluating the base and the fine-tuned model ..."))
        evaluation = client.jobs.wait_evaluation(job_id, evaluation.id, timeout=timeout)
    print_json(evaluation) if json_out else _print_evaluation(evaluation)
    if evaluation.status == "failed":
        raise typer.Exit(EXIT_JOB_FAILED)


@jobs_app.command("evaluations")
@client_command
def jobs_evaluations(
    client: Tunefleet,
    json_out: bool,
    job_id: str,
    limit: LimitOpt = 20,
    after: AfterOpt = None,
    fetch_all: AllOpt = False,
) -> None:
    """List a job's held-out evaluations, newest first: base and fine-tuned scores."""
    items, has_more = page_items(client.jobs.list_evaluations(job_id, limit=limit, after=after), fetch_all)
    rows = ((e.id, status_text(e.status), _grader_label(e), _rows(e), _score(e, "base"), _score(e, "fine_tuned"),
             e.file, fmt_time(e.created_at)) for e in items)
    print_list(json_out, items, f"evaluations of {job_id}",
               ["id", "status", "grader", "rows", "base", "fine-tuned", "file", "created"], rows, has_more=has_more)
