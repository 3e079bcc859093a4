"""The trainer's output directory: training config, metrics log, adapter manifest.

Layout (docs/internals.md)::

    adapter/adapter_config.json, adapter/adapter_model.safetensors   (peft_export)
    adapter/README.md, adapter/tokenizer*.json ...   model card + the base's tokenizer
    training_config.json   the spec without the report token
    metrics.jsonl          every metric row the trainer produced
    manifest.json          {"files": [{"name", "bytes", "sha256"}]}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainers.common.peft_export import complete_adapter_dir, model_card, write_manifest

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


def adapter_base_model(spec: Any) -> str:
    """The base model an exported adapter names: the public id, else the training path."""
    return spec.model.name or spec.model.path


def finish_adapter(adapter_dir: str | Path, spec: Any, notes: list[str] | None = None) -> None:
    """Complete an adapter the recipe just wrote (final output or checkpoint) for use
    outside the service: public base model id, tokenizer files and model card (with
    ``notes``, sentences of the recipe's, first)."""
    training = {
        "trainer": spec.trainer,
        "method": spec.method.model_dump(mode="json"),
        "adapter": spec.adapter.model_dump(mode="json"),
        "hyperparameters": spec.hyperparameters.model_dump(mode="json"),
        "data": {"format": spec.data.format, "max_seq_len": spec.data.max_seq_len,
                 "packing": spec.data.packing},
        "precision": spec.precision.model_dump(mode="json"),
        "seed": spec.seed,
    }
    notes = list(notes or [])
    if spec.adapter.quantization != "none":
        notes.append(
            f"QLoRA: trained against the base quantized to {spec.adapter.quantization} 4-bit; "
            "applied to the unquantized base it is close to, not the same as, what training saw."
        )
    base = adapter_base_model(spec)
    if spec.model.revision:
        notes.append(f"Trained on `{base}` at Hub commit `{spec.model.revision}` (the adapter's revision).")
    complete_adapter_dir(
        adapter_dir, base_model=base, revision=spec.model.revision,
        tokenizer_dir=None if spec.model.path.startswith("s3://") else spec.model.path,
        card=model_card(base_model=base, title=f"Fine-tuned adapter of job {spec.job_id}",
                        training=training, notes=notes),
    )


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, rows after the resumed step are dropped
    (they were produced after the checkpoint and will be produced again)."""

    def __init__(self, output_dir: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(output_dir) / METRICS_LOG
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None or not self.path.exists():
            # A fresh run, or a resume into an output dir of its own (from another run's
            # checkpoint): the log starts empty.
            self.path.write_text("", encoding="utf-8")
        else:
            keep = [
                line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            # Replaced whole: a kill mid-write leaves the old log, never half of the kept one.
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            os.replace(tmp, self.path)

    def append(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one whole line, or nothing: a write the disk cuts short (full)
        is taken back before the error goes on, so the log never ends in half a row."""
        line = memoryview((json.dumps(row) + "\n").encode("utf-8"))
        with open(self.path, "ab", buffering=0) as f:
            start = f.seek(0, os.SEEK_END)
            try:
                while line:
                    line = line[f.write(line):]
            except OSError:
                os.ftruncate(f.fileno(), start)
                raise

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def finalize_outputs(output_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``manifest.json`` over everything in the output dir; returns its file entries."""
    return write_manifest(output_dir)
