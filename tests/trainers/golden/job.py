"""The one job the golden-value and cross-trainer tests run on both trainers.

A 4-step run on the shared tiny Llama (``build_tiny_llama(seed=0)``) and the shared tiny
chat files (``tests/trainers/tiny_datasets.py``): 32 training rows, batches of 16 (two
micro-batches of 8: gradient accumulation), 2 epochs, so steps 2 and 4 each end an
epoch; a validation file and no eval cadence, so the only evaluation is the final one.
Everything in fp32 on one CPU device with one thread, which makes each trainer
deterministic run to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.spec import TrainerSpec

REPO = Path(__file__).resolve().parents[3]
TRAINERS = ("fsdp_qlora", "jax_lora")


def golden_spec(trainer: str, model_dir: Path, datasets: dict[str, Path], root: Path) -> TrainerSpec:
    """The golden job for ``trainer``, writing under ``root``."""
    return TrainerSpec.model_validate({
        "job_id": "ftjob-golden",
        "trainer": trainer,
        "model": {"path": str(model_dir)},
        "data": {"train_file": str(datasets["chat_train"]), "validation_file": str(datasets["chat_valid"]),
                 "format": "chat", "max_seq_len": 64},
        "hyperparameters": {"n_epochs": 2, "batch_size": 16, "micro_batch_size": 8, "learning_rate": 1e-2,
                            "warmup_steps": 1, "lr_scheduler": "cosine"},
        "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.0},
        "eval": {"every_n_steps": None},
        "output_dir": str(root / "output"),
        "checkpoint": {"dir": str(root / "checkpoints"), "every_n_steps": 2},
        "termination_log": str(root / "termination-log"),
        "seed": 7,
    })


@dataclass(frozen=True)
class EntryPointRun:
    """What ``python -m trainers --spec`` left behind: exit code, output, metric rows, reports."""

    returncode: int
    output: str
    metrics: list[dict[str, Any]]
    reports: list[dict[str, Any]]


def run_entry_point(spec: TrainerSpec, root: Path) -> EntryPointRun:
    """Run the real entry point on ``spec`` in a subprocess with the thread count fixed."""
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / "spec.json"
    spec.dump(spec_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device for JAX
    proc = subprocess.run(
        [sys.executable, "-m", "trainers", "--spec", str(spec_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    metrics_path = Path(spec.output_dir) / "metrics.jsonl"
    reports_path = Path(spec.checkpoint.dir) / "reports.jsonl"
    return EntryPointRun(
        returncode=proc.returncode,
        output=proc.stdout + proc.stderr,
        metrics=_jsonl(metrics_path),
        reports=_jsonl(reports_path),
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
