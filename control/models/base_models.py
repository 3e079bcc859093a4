"""The registry of base models a job may fine-tune, from YAML or the built-in default.

``TUNEFLEET_BASE_MODELS_FILE`` points to YAML like::

    models:
      - id: meta-llama/Llama-3.1-8B
        path: s3://models/llama-3.1-8b        # or a local directory (HF format)
        architecture: llama
        params_b: 8.0                          # billions, for the memory estimator
        max_seq_len: 131072
        hf_id: meta-llama/Llama-3.1-8B         # optional: the Hub id adapters cite (default: id)
        inference_url: http://vllm-llama-8b:8000  # optional: completions proxied there (api/inference/proxy.py)

Without it, the registry holds the demo model ``tunefleet-tiny-llama`` at
``<data>/models/tiny-llama`` (a random tiny Llama the demo builds on first start) and,
once it has been prepared (``tunefleet prepare-model`` or ``serve --demo``:
tunefleet/real_model.py), the real pretrained ``smollm2-135m-instruct`` at
``<data>/models/smollm2-135m-instruct``.

Admins may also register models through ``POST /v1/models`` (control/models/registry.py):
those rows of ``registered_models`` join the registry once ready. ``load_base_models``
returns a ``BaseModelRegistry``, a read-only mapping of both that reads the registrations
at each lookup, so every API process, the scheduler and the worker see a model as soon as
it is registered (and no longer once it is deleted). YAML ids win over registrations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.models import RegisteredModel
from control.db.session import session_factory
from control.settings import Settings
from trainers.spec import Architecture

DEMO_MODEL_ID = "tunefleet-tiny-llama"
# The real pretrained model of the default registry (tunefleet/real_model.py prepares it;
# its id and directory are repeated here because control/ does not import tunefleet/).
REAL_MODEL_ID = "smollm2-135m-instruct"
REAL_MODEL_DIRNAME = "smollm2-135m-instruct"
# Written last by the preparation: the directory is listed only once it is complete.
REAL_MODEL_READY_MARKER = ".tunefleet-ready"


class BaseModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256)
    path: str = Field(description="Local directory or s3:// URI of an HF-format checkpoint.")
    architecture: Architecture = "llama"
    params_b: float | None = Field(default=None, gt=0, description="Parameters in billions.")
    max_seq_len: int = Field(default=2048, ge=8)
    owned_by: str = "tunefleet"
    hf_id: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="The Hugging Face id exported adapters name as their base model; default: id.",
    )

    inference_url: str | None = Field(
        default=None, pattern=r"^https?://",
        description="An OpenAI-compatible server (vLLM with --enable-lora) that serves this model under "
        "its id and loads adapters on request: completions go there instead of the embedded worker.",
    )

    revision: str | None = Field(
        default=None, description="Hub models: the commit fetched (exported adapters cite it).",
    )

    @property
    def public_id(self) -> str:
        """What an exported adapter's ``base_model_name_or_path`` says."""
        return self.hf_id or self.id


class BaseModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[BaseModelEntry]


def demo_model(models_dir: Path) -> BaseModelEntry:
    """The built-in demo model (a random tiny Llama the demo writes into the data dir)."""
    return BaseModelEntry(
        id=DEMO_MODEL_ID, path=str(models_dir / "tiny-llama"), params_b=0.0001, max_seq_len=512
    )


def real_model(models_dir: Path) -> BaseModelEntry:
    """SmolLM2-135M-Instruct, dequantized from its 4-bit GGUF file. No ``hf_id``: the
    weights are not the Hub's bf16 ones, so exported adapters do not cite that id."""
    return BaseModelEntry(
        id=REAL_MODEL_ID, path=str(models_dir / REAL_MODEL_DIRNAME), params_b=0.135,
        max_seq_len=2048,
    )


def default_models(models_dir: Path) -> list[BaseModelEntry]:
    """The registry without a YAML file: the demo model, and the real one once prepared."""
    entries = [demo_model(models_dir)]
    if (models_dir / REAL_MODEL_DIRNAME / REAL_MODEL_READY_MARKER).exists():
        entries.append(real_model(models_dir))
    return entries


class BaseModelRegistry(Mapping[str, BaseModelEntry]):
    """The YAML (or demo) entries and the ready registrations, as ``{id: entry}``."""

    def __init__(self, declared: Mapping[str, BaseModelEntry],
                 sessions: Callable[[], Session] | None) -> None:
        self.declared = dict(declared)
        self._sessions = sessions

    def __getitem__(self, model_id: str) -> BaseModelEntry:
        entry = self.declared.get(model_id)
        if entry is not None:
            return entry
        if self._sessions is not None:
            with self._sessions() as session:
                row = session.get(RegisteredModel, model_id)
                if row is not None and row.status == "ready":
                    return registered_entry(row)
        raise KeyError(model_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        return len(self.snapshot())

    def snapshot(self) -> dict[str, BaseModelEntry]:
        """Every entry now: declared ones, then ready registrations (one query)."""
        entries = dict(self.declared)
        if self._sessions is not None:
            with self._sessions() as session:
                rows = session.scalars(select(RegisteredModel).where(RegisteredModel.status == "ready")
                                       .order_by(RegisteredModel.created_at))
                for row in rows:
                    entries.setdefault(row.id, registered_entry(row))
        return entries

    def keys(self):  # type: ignore[override] - one query instead of one per key
        return self.snapshot().keys()

    def values(self):  # type: ignore[override]
        return self.snapshot().values()

    def items(self):  # type: ignore[override]
        return self.snapshot().items()


def registered_entry(row: RegisteredModel) -> BaseModelEntry:
    """A ready registration as a registry entry."""
    return BaseModelEntry(
        id=row.id, path=row.path or "", architecture=row.architecture or "llama",
        params_b=row.params_b, max_seq_len=row.max_seq_len or 2048, owned_by="tunefleet",
        hf_id=row.hf_id, revision=row.commit_sha,
    )


def load_base_models(settings: Settings) -> BaseModelRegistry:
    """The registry; a broken YAML file is a start-up error."""
    # The default registry is not cached: a process that loads it after the real model was
    # prepared lists it (the API loads it at start: `serve --demo` prepares before that).
    if settings.base_models_file is None:
        declared = {entry.id: entry for entry in default_models(settings.models_dir)}
    else:
        declared = dict(_load(settings.base_models_file, settings.models_dir))
    return BaseModelRegistry(declared, session_factory(settings.resolved_database_url))


@lru_cache(maxsize=8)
def _load(path: Path, models_dir: Path) -> tuple[tuple[str, BaseModelEntry], ...]:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        entries = BaseModelsFile.model_validate(raw).models
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"TUNEFLEET_BASE_MODELS_FILE {path}: {exc}") from exc
    return tuple((entry.id, entry) for entry in entries)
