"""`tunefleet models ...`: the base models and fine-tuned adapters a tenant can use, and the
registration of base models by admins (``POST /v1/models``).

``tunefleet models`` alone lists them, as ``tunefleet models list`` does.
"""

# No `from __future__ import annotations`: typer reads the options' annotations at runtime.

from typing import Annotated

import typer

from tunefleet.cli.options import ApiKeyOpt, BaseUrlOpt, JsonOpt, client_command, connected
from tunefleet.cli.render import console, fmt_time, key_values, print_json, print_list
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.types import Model

models_app = typer.Typer(help="Base models and fine-tuned adapters; admins register base models.")


def _list(client: Tunefleet, json_out: bool) -> None:
    items = list(client.models.list())
    rows = ((m.id, (m.model_extra or {}).get("kind"), m.owned_by, fmt_time(m.created)) for m in items)
    print_list(json_out, items, "models", ["id", "kind", "owned by", "created"], rows)


@models_app.callback(invoke_without_command=True)
def models(
    ctx: typer.Context,
    json_out: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Base models and fine-tuned adapters you can use (`models` alone lists them)."""
    if ctx.invoked_subcommand is not None:
        return
    with connected(json_out, base_url, api_key) as client:
        _list(client, json_out)


@models_app.command("list")
@client_command
def models_list(client: Tunefleet, json_out: bool) -> None:
    """List base models and fine-tuned adapters you can use."""
    _list(client, json_out)


def print_model(model: Model) -> None:
    extra = model.model_extra or {}
    pairs = [("id", model.id), ("kind", extra.get("kind")), ("status", extra.get("status")),
             ("owned by", model.owned_by), ("created", fmt_time(model.created))]
    pairs += [(key.replace("_", " "), extra.get(key)) for key in
              ("architecture", "max_seq_len", "parent", "fine_tuning_job", "source", "revision")]
    error = extra.get("error")
    if isinstance(error, dict):
        pairs.append(("error", f"[{error.get('code')}] {error.get('message')}"))
    console.print(key_values(f"model {model.id}", pairs))


@models_app.command("get")
@client_command
def models_get(client: Tunefleet, json_out: bool, model_id: str) -> None:
    """Show one model: a base model, a fine-tuned model or one of its checkpoints."""
    model = client.models.retrieve(model_id)
    print_json(model) if json_out else print_model(model)


@models_app.command("register")
@client_command
def models_register(
    client: Tunefleet,
    json_out: bool,
    source: Annotated[str, typer.Argument(
        help="An absolute directory (under the operator's TUNEFLEET_MODEL_ROOTS) or s3:// prefix of a "
             "Hugging Face checkpoint, or a Hub id org/name[@revision] the operator allows.")],
    model_id: Annotated[str | None, typer.Option(
        "--id", help="The id jobs name as their model (default for a Hub source: its repo id).")] = None,
    hf_id: Annotated[str | None, typer.Option(
        "--hf-id", help="The Hub id exported adapters name as their base (default: the Hub repo, or the id).")
    ] = None,
) -> None:
    """Register a base model (admin key).

    A checkpoint is checked now and answers `ready`; a Hub id answers `fetching` until the
    worker has downloaded it (see `models get`)."""
    model = client.models.register(source=source, id=model_id, hf_id=hf_id)
    print_json(model) if json_out else print_model(model)
