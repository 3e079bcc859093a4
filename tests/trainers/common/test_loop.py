"""The train loop's shared decisions: eval cadence, epoch numbering, NaN policy, metric
row, checkpoint metrics, and the resume rule."""

from __future__ import annotations

import math

import pytest

from trainers.common.checkpointing import TRAINER_STATE, resolve_resume
from trainers.common.data import DataCursor
from trainers.common.loop import (
    METRIC_KEYS,
    check_finite,
    checkpoint_metrics,
    epoch_of_step,
    metric_row,
    should_evaluate,
)
from trainers.common.reinforcement import GRADING_KEYS, REINFORCEMENT_KEYS, VALID_REINFORCEMENT_KEYS
from trainers.errors import UserError
from trainers.spec import CheckpointSpec


@pytest.mark.parametrize(
    ("every", "has_validation", "total", "expected"),
    [
        (None, True, 5, [5]),  # no cadence: the end only
        (2, True, 5, [2, 4, 5]),
        (2, True, 4, [2, 4]),  # the end is on the cadence: once
        (10, True, 3, [3]),
        (2, False, 5, []),  # nothing to evaluate on
        (None, False, 5, []),
    ],
)
def test_eval_cadence(every, has_validation, total, expected):
    steps = [s for s in range(1, total + 1)
             if should_evaluate(s, total_steps=total, every_n_steps=every, has_validation=has_validation)]
    assert steps == expected


@pytest.mark.parametrize(
    ("cursor", "epoch"),
    [
        (DataCursor(0, 4), 0),
        (DataCursor(1, 0), 0),  # the step that read epoch 0's last row
        (DataCursor(1, 2), 1),
        (DataCursor(3, 0), 2),
        (DataCursor(0, 0), 0),
    ],
)
def test_epoch_of_a_step_is_the_epoch_of_its_last_row(cursor, epoch):
    assert epoch_of_step(cursor) == epoch


@pytest.mark.parametrize(("loss", "grad_norm"), [(math.nan, 1.0), (math.inf, 1.0), (1.0, math.nan), (1.0, math.inf)])
def test_a_non_finite_loss_or_grad_norm_is_nan_loss(loss, grad_norm):
    with pytest.raises(UserError) as exc:
        check_finite(3, loss, grad_norm)
    assert exc.value.code == "nan_loss" and "step 3" in exc.value.message


def test_finite_steps_pass():
    check_finite(1, 2.5, 0.3)
    check_finite(1, 2.5, None)


def _row(**changes):
    base = {"step": 4, "total_steps": 8, "cursor_after": DataCursor(1, 0), "train_loss": 2.0,
            "learning_rate": 1e-3, "grad_norm": 0.5, "step_tokens": 100, "elapsed_s": 0.5,
            "tokens_seen": 400, "memory_bytes": 1024}
    return metric_row(**{**base, **changes})


def test_metric_row_has_the_report_keys_and_derived_values():
    row = _row()
    assert tuple(row) == METRIC_KEYS
    assert row["epoch"] == 0 and row["tokens_per_s"] == 200.0
    assert row["valid_loss"] is None and row["token_accuracy"] is None
    evaluated = _row(evaluation={"valid_loss": 1.5, "token_accuracy": 0.25}, elapsed_s=0.0)
    assert (evaluated["valid_loss"], evaluated["token_accuracy"]) == (1.5, 0.25)
    assert evaluated["tokens_per_s"] is None


def test_checkpoint_metrics_keep_the_latest_evaluation():
    first = checkpoint_metrics(_row(evaluation={"valid_loss": 1.5, "token_accuracy": 0.25}))
    later = checkpoint_metrics(_row(train_loss=1.0), first)
    assert later == {"train_loss": 1.0, "valid_loss": 1.5, "token_accuracy": 0.25}


def test_a_reinforcement_row_carries_its_grading_and_a_checkpoint_does_not():
    rewards = {"reward_mean": 0.5, "reward_std": 0.25, "kl": None, "clip_fraction": 0.0, "completion_length": 3.0,
               "sub_rewards": {"exact": 0.25, "has_a": 0.75}, "grader_errors": 2}
    row = _row(rewards=rewards)
    assert tuple(row) == METRIC_KEYS + REINFORCEMENT_KEYS + GRADING_KEYS + VALID_REINFORCEMENT_KEYS
    assert (row["sub_rewards"], row["grader_errors"]) == ({"exact": 0.25, "has_a": 0.75}, 2)
    # A checkpoint's metrics are single numbers (the API refuses anything else there).
    saved = checkpoint_metrics(row)
    assert not set(GRADING_KEYS) & set(saved) and saved["reward_mean"] == 0.5


def _ckpt(tmp_path, resume_from):
    return CheckpointSpec(dir=str(tmp_path / "ckpt"), resume_from=resume_from)


def test_resume_rule(tmp_path):
    assert resolve_resume(_ckpt(tmp_path, None)) is None
    assert resolve_resume(_ckpt(tmp_path, "latest")) is None  # first start: nothing yet
    for step in (2, 4):
        (tmp_path / "ckpt" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step-{step}" / TRAINER_STATE).write_text("{}")
    (tmp_path / "ckpt" / "step-6").mkdir()  # incomplete: never picked
    assert resolve_resume(_ckpt(tmp_path, "latest")) == tmp_path / "ckpt" / "step-4"
    explicit = tmp_path / "ckpt" / "step-2"
    assert resolve_resume(_ckpt(tmp_path, str(explicit))) == explicit


@pytest.mark.parametrize("where", ["missing", "incomplete", "a file"])
def test_resume_from_something_that_is_not_a_checkpoint_is_refused(tmp_path, where):
    target = tmp_path / "target"
    if where == "incomplete":
        target.mkdir()
    elif where == "a file":
        target.write_text("x")
    with pytest.raises(UserError) as exc:
        resolve_resume(_ckpt(tmp_path, str(target)))
    assert exc.value.code == "checkpoint_not_found"
