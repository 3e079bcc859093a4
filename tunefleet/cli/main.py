"""The root of the `tunefleet` command line (the console script's entry point: ``app``).

Each command group lives in its own module and knows nothing of this root; this module
puts them together. Client commands talk to the service through the SDK: ``files``,
``jobs`` (with ``estimate``), ``webhooks``, ``pools``, ``models``, ``chat``, ``login``
(with ``config``). Operator commands run or administer the service itself: ``admin`` (``db``,
``admin``) and ``operator`` (``serve``, ``worker``, ``scheduler``, ``inference``). Options they share
are in ``options``; how results look is in ``render``.
"""

import typer

from tunefleet.cli import admin, chat, files, jobs, login, models, operator, pools, webhooks

app = typer.Typer(
    name="tunefleet",
    help="Self-hosted LLM fine-tuning service: submit, watch and operate fine-tuning jobs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

# `tunefleet --help` lists the commands in this order, then the groups in theirs.
app.command("estimate")(jobs.estimate)
app.command("pools")(pools.pools)
app.command("chat")(chat.chat)
app.command("login")(login.login)
app.command("config")(login.show_config)
app.command("worker")(operator.worker)
app.command("scheduler")(operator.scheduler)
app.command("inference")(operator.inference)
app.command("serve")(operator.serve)
app.command("prepare-model")(operator.prepare_model)

app.add_typer(files.files_app, name="files")
app.add_typer(jobs.jobs_app, name="jobs")
app.add_typer(models.models_app, name="models")
app.add_typer(webhooks.webhooks_app, name="webhooks")
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.admin_app, name="admin")
