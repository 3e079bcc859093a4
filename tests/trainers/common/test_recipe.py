"""The recipe interface (``trainers.common.recipe``): both trainers implement it, the
entry point loads it, and the common loop keeps one stop contract and one output order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainers.common.data import DataCursor
from trainers.common.outputs import MetricsLog
from trainers.common.recipe import Progress, Recipe, SteppedRecipe, StepResult, run_recipe
from trainers.common.reinforcement import GradingSummary
from trainers.common.reporter import Reporter
from trainers.common.signals import StopFlag
from trainers.errors import Preempted, UserError
from trainers.spec import TrainerSpec


def test_every_trainer_is_a_recipe_the_entry_point_loads():
    from trainers.__main__ import load_recipe
    from trainers.fsdp_qlora.launch import FsdpQloraLauncher
    from trainers.fsdp_qlora.recipe import FsdpQloraRecipe
    from trainers.jax_lora.recipe import JaxLoraRecipe

    assert load_recipe("jax_lora") is JaxLoraRecipe
    assert load_recipe("fsdp_qlora") is FsdpQloraLauncher
    assert issubclass(FsdpQloraLauncher, Recipe)
    # Both trainers' ranks run the one common loop.
    assert issubclass(JaxLoraRecipe, SteppedRecipe) and issubclass(FsdpQloraRecipe, SteppedRecipe)
    assert JaxLoraRecipe.train is FsdpQloraRecipe.train is SteppedRecipe.train
    assert JaxLoraRecipe.save is FsdpQloraRecipe.save is SteppedRecipe.save


class FakeRecipe(SteppedRecipe):
    """A framework-free recipe that records what the common loop asks of it, in order."""

    def __init__(self, *, total_steps: int = 5, loss: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n, self.loss = total_steps, loss
        self.calls: list[str] = []

    def setup(self, spec: Any, reporter: Reporter, stop: StopFlag) -> None:
        self.spec, self.reporter, self.stop = spec, reporter, stop
        self.primary, self.total_steps, self.has_validation = True, self.n, True
        self.progress = Progress()
        self.output_dir = Path(spec.output_dir)
        self.metrics_log = MetricsLog(self.output_dir)
        self.calls.append("setup")

    def train_step(self, step: int) -> StepResult:
        self.calls.append(f"step {step + 1}")
        return StepResult(loss=self.loss, grad_norm=0.5, learning_rate=1e-3, tokens=10, elapsed_s=0.1,
                          cursor_after=DataCursor(0, 4 * (step + 1)))

    def evaluate(self) -> dict[str, Any]:
        self.calls.append("evaluate")
        return {"valid_loss": 2.0, "token_accuracy": 0.5}

    def memory_bytes(self) -> int | None:
        return None

    def write_checkpoint(self, progress: Progress) -> Path | None:
        rows = self.metrics_log.rows() if self.metrics_log else []
        assert rows and rows[-1]["step"] == progress.step  # the step's row comes first
        self.calls.append(f"checkpoint {progress.step}")
        return None

    def export_adapter(self, adapter_dir: Path) -> None:
        self.calls.append("adapter")
        adapter_dir.mkdir(parents=True)
        (adapter_dir / "adapter_model.safetensors").write_bytes(b"")

    def write_extra_outputs(self, output_dir: Path) -> None:
        self.calls.append("extra outputs")

    def finish(self) -> None:
        self.calls.append("finish")

    def cleanup(self) -> None:
        self.calls.append("cleanup")


@pytest.fixture
def spec(tmp_path) -> TrainerSpec:
    """Nothing is read from its paths: the fake recipe trains on nothing."""
    return TrainerSpec.model_validate({
        "job_id": "ftjob-recipe", "trainer": "jax_lora",
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 2, "learning_rate": 1e-3,
                            "max_steps": 5},
        "eval": {"every_n_steps": 2},
        "output_dir": str(tmp_path / "out"),
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_n_steps": 2},
    })


def _reports(spec: TrainerSpec) -> list[dict[str, Any]]:
    path = Path(spec.checkpoint.dir) / "reports.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_writes_rows_then_checkpoints_then_the_adapter_then_the_manifest(spec):
    recipe = FakeRecipe()
    result = run_recipe(recipe, spec)
    assert recipe.calls == [
        "setup",
        "step 1", "step 2", "evaluate", "checkpoint 2", "step 3", "step 4", "evaluate", "checkpoint 4",
        "step 5", "evaluate", "checkpoint 5",  # the last step: evaluated and checkpointed once
        "adapter", "extra outputs", "finish", "cleanup",
    ]
    assert (result.final_step, sorted(result.losses)) == (5, [1, 2, 3, 4, 5])
    out = Path(spec.output_dir)
    manifest = {f["name"] for f in json.loads((out / "manifest.json").read_text())["files"]}
    assert {"metrics.jsonl", "training_config.json", "adapter/adapter_model.safetensors"} <= manifest
    reports = _reports(spec)
    assert [r["step"] for r in reports if r["type"] == "metric"] == [1, 2, 3, 4, 5]
    assert [r["type"] for r in reports][-2:] == ["artifacts", "event"]


def test_a_stop_is_checked_after_a_completed_step_before_the_next(spec):
    stop = StopFlag()
    recipe = FakeRecipe(on_step=lambda step: stop.request("SIGTERM") if step == 3 else None)
    with pytest.raises(Preempted, match="at step 3"):
        run_recipe(recipe, spec, stop=stop)
    assert recipe.calls[-3:] == ["step 3", "checkpoint 3", "cleanup"]
    assert any(r.get("message") == "preempted (SIGTERM) at step 3; checkpoint written" for r in _reports(spec))


def test_a_stop_on_a_periodic_checkpoint_writes_it_once(spec):
    stop = StopFlag()
    recipe = FakeRecipe(on_step=lambda step: stop.request("SIGTERM") if step == 2 else None)
    with pytest.raises(Preempted, match="at step 2"):
        run_recipe(recipe, spec, stop=stop)
    assert recipe.calls.count("checkpoint 2") == 1 and "step 3" not in recipe.calls


def test_a_stop_before_the_first_step_has_nothing_to_checkpoint(spec):
    stop = StopFlag()
    stop.request("SIGTERM")
    recipe = FakeRecipe()
    with pytest.raises(Preempted, match="before the first step"):
        run_recipe(recipe, spec, stop=stop)
    assert recipe.calls == ["setup", "cleanup"]


def test_a_stop_during_the_last_step_lets_the_run_finish(spec):
    stop = StopFlag()
    recipe = FakeRecipe(on_step=lambda step: stop.request("SIGTERM") if step == 5 else None)
    result = run_recipe(recipe, spec, stop=stop)
    assert result.final_step == 5 and recipe.calls[-4:] == ["adapter", "extra outputs", "finish", "cleanup"]


def test_a_non_finite_loss_stops_before_its_row_and_still_cleans_up(spec):
    recipe = FakeRecipe(loss=float("nan"))
    with pytest.raises(UserError) as err:
        run_recipe(recipe, spec)
    assert err.value.code == "nan_loss"
    assert recipe.calls == ["setup", "step 1", "cleanup"]
    assert (Path(spec.output_dir) / "metrics.jsonl").read_text() == ""


class GradedRecipe(FakeRecipe):
    """A reinforcement-like fake: each step's grading summary is given in advance."""

    def __init__(self, gradings: list[GradingSummary], **kwargs: Any) -> None:
        super().__init__(total_steps=len(gradings), **kwargs)
        self.gradings = gradings

    def train_step(self, step: int) -> StepResult:
        grading = self.gradings[step]
        return StepResult(loss=self.loss, grad_norm=0.5, learning_rate=1e-3, tokens=10, elapsed_s=0.1,
                          cursor_after=DataCursor(0, 4 * (step + 1)), grading=grading,
                          rewards={"reward_mean": 0.0, **grading.metrics()})


def test_grader_errors_raise_a_warning_at_their_first_step_and_at_a_new_kind(spec):
    def failing(n: int, kind: str) -> GradingSummary:
        return GradingSummary(samples=8, errors=n, error_kinds={kind: n}, error_detail="ValueError: boom")

    gradings = [GradingSummary(samples=8), failing(8, "python_grader_runtime_error"),
                failing(8, "python_grader_runtime_error"), failing(2, "python_grader_server_error"),
                failing(8, "python_grader_runtime_error")]
    run_recipe(GradedRecipe(gradings), spec)
    reports = _reports(spec)
    assert [r["grader_errors"] for r in reports if r["type"] == "metric"] == [0, 8, 8, 2, 8]
    warnings = [r for r in reports if r["type"] == "event" and r["level"] == "warn"]
    assert [(w["data"]["step"], w["data"]["error_kinds"]) for w in warnings] == [
        (2, {"python_grader_runtime_error": 8}), (4, {"python_grader_server_error": 2})]
