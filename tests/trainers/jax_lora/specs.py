"""Trainer specs for the recipe tests, and a run stopped and resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainers.common.signals import StopFlag
from trainers.errors import Preempted
from trainers.spec import TrainerSpec


def make_spec(model_dir: Path, files: dict[str, Path], root: Path, **overrides: Any) -> TrainerSpec:
    """A small jax_lora spec; ``overrides`` are merged one level deep into the sections."""
    raw: dict[str, Any] = {
        "job_id": "ftjob-test",
        "trainer": "jax_lora",
        "model": {"path": str(model_dir)},
        "data": {
            "train_file": str(files["chat_train"]), "validation_file": str(files["chat_valid"]),
            "format": "chat", "max_seq_len": 64, "packing": False,
        },
        "hyperparameters": {
            "n_epochs": 1, "batch_size": 4, "micro_batch_size": 1, "learning_rate": 1e-2,
            "warmup_steps": 1, "max_steps": 4, "lr_scheduler": "cosine",
        },
        "adapter": {"r": 4, "alpha": 8.0},
        "output_dir": str(root / "out"),
        "checkpoint": {"dir": str(root / "ckpt"), "every_n_steps": 2},
        "eval": {"every_n_steps": 2},
        "termination_log": str(root / "termination.log"),
        "seed": 7,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return TrainerSpec.model_validate(raw)


def run_stopped_and_resumed(spec: TrainerSpec, stop_after: int) -> None:
    """Run ``spec`` in this process, stopped (``Preempted``) after step ``stop_after``, then
    resumed from its latest checkpoint to the end."""
    from trainers.jax_lora.recipe import run

    stop = StopFlag()
    with pytest.raises(Preempted):
        run(spec, stop=stop, on_step=lambda step: stop.request("test") if step == stop_after else None)
    run(spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"resume_from": "latest"})}))
