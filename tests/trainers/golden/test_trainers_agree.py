"""One job spec on both trainers: the same report shape, cadence and epoch numbers.

Runs the golden job (``job.py``: 2 epochs of 2 steps, a validation file, no eval cadence)
through the real entry point on ``fsdp_qlora`` and ``jax_lora`` and compares what they
report. The numbers of later steps differ (each framework draws its own LoRA init), but
step 1 does not: LoRA's B starts at zero, so both report the base model's loss.
"""

from __future__ import annotations

import pytest

from tests.trainers.golden.job import TRAINERS
from trainers.common.loop import METRIC_KEYS
from trainers.exit_codes import ExitCode


@pytest.fixture(scope="module")
def runs(golden_runs):
    for trainer in TRAINERS:
        run = golden_runs[trainer]
        assert run.returncode == ExitCode.SUCCESS, f"{trainer}: {run.output[-3000:]}"
    return golden_runs


def _reported_metrics(run):
    return [item for item in run.reports if item["type"] == "metric"]


def test_both_trainers_report_the_same_metric_keys(runs):
    for trainer in TRAINERS:
        for row in runs[trainer].metrics:
            assert tuple(row) == METRIC_KEYS, trainer
        for item in _reported_metrics(runs[trainer]):
            assert set(item) == {"type", "seq", *METRIC_KEYS}, trainer


def test_same_steps_epochs_tokens_learning_rates_and_checkpoints(runs):
    def shape(run):
        return {
            "steps": [r["step"] for r in run.metrics],
            "total_steps": {r["total_steps"] for r in run.metrics},
            # the step that reads an epoch's last row belongs to that epoch
            "epochs": [r["epoch"] for r in run.metrics],
            "tokens_seen": [r["tokens_seen"] for r in run.metrics],
            "checkpoints": [i["step"] for i in run.reports if i["type"] == "checkpoint"],
        }

    fsdp, jax = shape(runs["fsdp_qlora"]), shape(runs["jax_lora"])
    assert fsdp == jax
    # the same schedule; JAX evaluates it in float32
    lrs = {t: [r["learning_rate"] for r in runs[t].metrics] for t in TRAINERS}
    assert lrs["jax_lora"] == pytest.approx(lrs["fsdp_qlora"], rel=1e-6)
    assert fsdp["steps"] == [1, 2, 3, 4] and fsdp["epochs"] == [0, 0, 1, 1]
    assert fsdp["checkpoints"] == [2, 4]


def test_same_eval_steps_and_a_final_valid_loss_on_both(runs):
    for trainer in TRAINERS:
        rows = runs[trainer].metrics
        # eval.every_n_steps is None: the only evaluation is after the last step
        assert [r["step"] for r in rows if r["valid_loss"] is not None] == [4], trainer
        assert [r["step"] for r in rows if r["token_accuracy"] is not None] == [4], trainer
        assert 0.0 <= rows[-1]["token_accuracy"] <= 1.0


def test_step_one_is_the_base_models_loss_on_both(runs):
    first = {t: runs[t].metrics[0]["train_loss"] for t in TRAINERS}
    assert first["fsdp_qlora"] == pytest.approx(first["jax_lora"], abs=1e-5)
