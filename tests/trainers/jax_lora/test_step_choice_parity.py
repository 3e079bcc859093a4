"""The scheduler's step choice (``scheduling.step_choice``) changes how a jax_lora step is
computed, never what it computes: step 1's loss with a micro batch of 4 and no
rematerialization equals the loss of micro batches of 1 with per-layer rematerialization
(the same global batch), through the real entry point, with the spec carrying the planned
memory the scheduler writes.

Before its first step the recipe compiles the planned step and checks XLA's plan against
the device's memory (``trainers/jax_lora/step_fit.py``): a device too small for the planned
step gets the next choice that fits (same loss), and one too small for every choice fails
with ``out_of_memory`` before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainers.jax_lora.specs import make_spec
from tests.trainers.jax_lora.test_recipe_smoke import _run_entry
from trainers.common.step_fit import USABLE
from trainers.exit_codes import ExitCode
from trainers.jax_lora.step_fit import StepFit, device_limit_bytes, fallback_steps


def _run(recipe_model, tiny_datasets, root: Path, *, micro: int, remat: str, device_bytes: int | None = None,
         batch: int = 4):
    root.mkdir()
    spec = make_spec(recipe_model, tiny_datasets, root,
                     hyperparameters={"max_steps": 1, "batch_size": batch, "micro_batch_size": micro},
                     parallelism={"remat": remat, "planned_memory_bytes": 123_456_789,
                                  "device_memory_bytes": device_bytes},
                     eval={"every_n_steps": None})
    return spec, _run_entry(spec, root)


def _first_loss_and_step_event(spec, proc) -> tuple[float, dict]:
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    reports = [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]
    (event,) = [r for r in reports if r.get("type") == "event" and r["message"].startswith("step ")]
    return rows[0]["train_loss"], event


def test_step_one_loss_does_not_depend_on_the_micro_batch_or_remat(recipe_model, tiny_datasets, tmp_path):
    single, _ = _first_loss_and_step_event(
        *_run(recipe_model, tiny_datasets, tmp_path / "micro1", micro=1, remat="per_layer"))
    whole, confirmed = _first_loss_and_step_event(
        *_run(recipe_model, tiny_datasets, tmp_path / "micro4", micro=4, remat="none", device_bytes=2**40))
    assert whole == pytest.approx(single, abs=1e-5)
    assert confirmed["message"].startswith("step confirmed: micro-batch 4, no remat: XLA plans")
    planned = confirmed["data"]["xla_bytes"]
    assert 0 < planned < confirmed["data"]["limit_bytes"]

    # A device one byte too small for the planned step: the next choice in the speed order
    # (micro-batch 2, still no remat) runs, with the same loss.
    small = int((planned - 1) / USABLE)
    stepped, event = _first_loss_and_step_event(
        *_run(recipe_model, tiny_datasets, tmp_path / "small", micro=4, remat="none", device_bytes=small))
    assert event["message"].startswith("step stepped down: micro-batch 4, no remat: XLA plans")
    assert event["data"]["step"] == {"micro_batch": 2, "remat": "none"}
    first, chosen = event["data"]["tried"]
    assert first["xla_bytes"] == planned > first["limit_bytes"] >= chosen["xla_bytes"]
    assert stepped == pytest.approx(single, abs=1e-5)


def test_a_device_too_small_for_every_step_fails_before_training(recipe_model, tiny_datasets, tmp_path):
    spec, proc = _run(recipe_model, tiny_datasets, tmp_path / "tiny", micro=1, remat="per_layer", batch=1,
                      device_bytes=1)
    assert proc.returncode == ExitCode.OUT_OF_MEMORY, proc.stderr[-3000:]
    error = json.loads(Path(spec.termination_log).read_text())
    assert error["code"] == "out_of_memory"
    assert error["message"].startswith("no step fits one device: micro-batch 1, remat per_layer: XLA plans")
    reports = [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]
    assert not [r for r in reports if r.get("type") == "metric"]


def test_fallbacks_follow_the_speed_order() -> None:
    assert fallback_steps(4, 4, "none") == [
        (2, "none"), (1, "none"), (4, "dots_saveable"), (2, "dots_saveable"), (1, "dots_saveable"),
        (4, "per_layer"), (2, "per_layer"), (1, "per_layer")]
    assert fallback_steps(6, 3, "dots_saveable") == [
        (2, "dots_saveable"), (1, "dots_saveable"), (6, "per_layer"), (3, "per_layer"), (2, "per_layer"),
        (1, "per_layer")]
    assert fallback_steps(2, 1, "per_layer") == []


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_the_device_limit_is_the_smaller_of_the_pool_and_the_allocator(recipe_model, tiny_datasets, tmp_path):
    spec = make_spec(recipe_model, tiny_datasets, tmp_path, parallelism={"device_memory_bytes": 1000})
    assert device_limit_bytes(spec, _Device(None)) == 900
    assert device_limit_bytes(spec, _Device(RuntimeError("cpu"))) == 900
    assert device_limit_bytes(spec, _Device({"bytes_limit": 800})) == 800
    assert device_limit_bytes(spec, _Device({"bytes_limit": 5000})) == 900
    unplanned = make_spec(recipe_model, tiny_datasets, tmp_path)
    assert device_limit_bytes(unplanned, _Device(None)) is None
    assert device_limit_bytes(unplanned, _Device({"bytes_limit": 800})) == 800
    assert StepFit(2, "none", 10, None).fits and not StepFit(2, "none", 10, 9).fits
