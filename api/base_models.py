"""The registry of base models a job may fine-tune, from YAML or the built-in default.

``TUNEFLEET_BASE_MODELS_FILE`` points to YAML like::

    models:
      - id: meta-llama/Llama-3.1-8B
        path: s3://models/llama-3.1-8b        # or a local directory (HF format)
        architecture: llama
        params_b: 8.0                          # billions, for the memory estimator
        max_seq_len: 131072
        hf_id: meta-llama/Llama-3.1-8B         # optional: the Hub id adapters cite (default: id)
        inference_url: http://vllm-llama-8b:8000  # optional: completions proxied there (api/inference_proxy.py)

Without it, the registry holds the demo model ``tunefleet-tiny-llama`` at
``<data>/models/tiny-llama`` (a random tiny Llama the demo builds on first start).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.settings import Settings
from trainers.spec import Architecture

DEMO_MODEL_ID = "tunefleet-tiny-llama"


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


def load_base_models(settings: Settings) -> dict[str, BaseModelEntry]:
    """The registry as ``{id: entry}``; a broken YAML file is a start-up error."""
    return dict(_load(settings.base_models_file, settings.models_dir))


@lru_cache(maxsize=8)
def _load(path: Path | None, models_dir: Path) -> tuple[tuple[str, BaseModelEntry], ...]:
    if path is None:
        entries = [demo_model(models_dir)]
    else:
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
            entries = BaseModelsFile.model_validate(raw).models
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            raise ValueError(f"TUNEFLEET_BASE_MODELS_FILE {path}: {exc}") from exc
    return tuple((entry.id, entry) for entry in entries)
