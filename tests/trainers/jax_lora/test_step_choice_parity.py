"""The scheduler's step choice (``scheduling.step_choice``) changes how a jax_lora step is
computed, never what it computes: step 1's loss with a micro batch of 4 and no
rematerialization equals the loss of micro batches of 1 with per-layer rematerialization
(the same global batch), through the real entry point, with the spec carrying the planned
memory the scheduler writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainers.jax_lora.specs import make_spec
from tests.trainers.jax_lora.test_recipe_smoke import _run_entry
from trainers.exit_codes import ExitCode


def _first_loss(recipe_model, tiny_datasets, root: Path, *, micro: int, remat: str) -> float:
    root.mkdir()
    spec = make_spec(recipe_model, tiny_datasets, root,
                     hyperparameters={"max_steps": 1, "batch_size": 4, "micro_batch_size": micro},
                     parallelism={"remat": remat, "planned_memory_bytes": 123_456_789},
                     eval={"every_n_steps": None})
    proc = _run_entry(spec, root)
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows[0]["train_loss"]


def test_step_one_loss_does_not_depend_on_the_micro_batch_or_remat(recipe_model, tiny_datasets, tmp_path):
    single = _first_loss(recipe_model, tiny_datasets, tmp_path / "micro1", micro=1, remat="per_layer")
    whole = _first_loss(recipe_model, tiny_datasets, tmp_path / "micro4", micro=4, remat="none")
    assert whole == pytest.approx(single, abs=1e-5)
