"""The trainer's output directory: training config, metrics log, adapter manifest.

Layout (docs/internals.md)::

    adapter/adapter_config.json, adapter/adapter_model.safetensors   (peft_export)
    training_config.json   the spec without the report token
    metrics.jsonl          every metric row the trainer produced
    manifest.json          {"files": [{"name", "bytes", "sha256"}]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainers.common.peft_export import write_manifest

TRAINING_CONFIG = "training_config.json"
METRICS_LOG = "metrics.jsonl"
ADAPTER_DIR = "adapter"


def write_training_config(output_dir: str | Path, spec: Any) -> Path:
    """Write the spec as JSON with the report token removed (it is a credential)."""
    data = spec.model_dump(mode="json")
    if data.get("report", {}).get("token") is not None:
        data["report"]["token"] = None
    path = Path(output_dir) / TRAINING_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, rows after the resumed step are dropped
    (they were produced after the checkpoint and will be produced again)."""

    def __init__(self, output_dir: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(output_dir) / METRICS_LOG
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("", encoding="utf-8")
        elif self.path.exists():
            keep = [
                line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")

    def append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def finalize_outputs(output_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``manifest.json`` over everything in the output dir; returns its file entries."""
    return write_manifest(output_dir)
