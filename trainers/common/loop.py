"""The train loop's framework-free decisions, made once for both trainers.

Both recipes run the same loop (``trainers.common.recipe.SteppedRecipe.train``); each
supplies its framework's step, evaluation and checkpoint. What does not depend on the
framework is decided here, so the same job reports the same rows on either trainer:

- :func:`should_evaluate`: the eval cadence (``eval.every_n_steps``, and always after
  the last step when there is a validation set, so every run that has one ends with a
  ``valid_loss``);
- :func:`should_checkpoint`: the periodic checkpoint cadence (``checkpoint.every_n_steps``;
  the run's last step is checkpointed once, by the end of training);
- :func:`epoch_of_step`: which 0-based epoch an optimizer step belongs to;
- :func:`check_finite`: a non-finite loss OR gradient norm stops the run with the user
  error ``nan_loss`` (the update is already poisoned; continuing would export NaNs);
- :func:`metric_row`: the dict reported for every step (``docs/internals.md``, "Trainer
  reports") and appended to ``metrics.jsonl``. A DPO run's rows also carry the reward
  metrics under TRL's names (``rewards/chosen``, ``rewards/rejected``,
  ``rewards/accuracy``, ``rewards/margin``, and ``valid_rewards/...`` when the step
  evaluated); ``train_loss`` / ``valid_loss`` are then the DPO objective. A reinforcement
  run's rows carry ``reward_mean``, ``reward_std``, ``kl``, ``clip_fraction`` and
  ``completion_length`` (``trainers.common.reinforcement``), ``sub_rewards`` (a ``multi``
  grader's sub-graders' mean rewards by name, None for other graders) and ``grader_errors``
  (the completions the grader could not score) and, when the step evaluated,
  ``valid_reward_mean``; ``train_loss`` is then GRPO's loss and ``valid_loss`` None.
"""

from __future__ import annotations

import math
import time
from typing import Any

from trainers.common.data import DataCursor
from trainers.common.preference import REWARD_KEYS, VALID_REWARD_KEYS
from trainers.common.reinforcement import GRADING_KEYS, REINFORCEMENT_KEYS, VALID_REINFORCEMENT_KEYS
from trainers.errors import UserError

METRIC_KEYS = (
    "step", "total_steps", "epoch", "train_loss", "learning_rate", "grad_norm", "tokens_per_s",
    "tokens_seen", "memory_bytes", "valid_loss", "token_accuracy", "time",
)
EVAL_KEYS = ("valid_loss", "token_accuracy")


def _method_keys(rewards: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (step, evaluation) keys of a run's ``rewards``: DPO's or reinforcement's."""
    if REWARD_KEYS[0] in rewards:
        return REWARD_KEYS, VALID_REWARD_KEYS
    return REINFORCEMENT_KEYS, VALID_REINFORCEMENT_KEYS


def should_evaluate(step: int, *, total_steps: int, every_n_steps: int | None, has_validation: bool) -> bool:
    """Whether to evaluate after optimizer step ``step`` (1-based).

    Every ``every_n_steps`` steps, and after the last step, as long as there is a
    validation set; ``every_n_steps=None`` means at the end only.
    """
    if not has_validation:
        return False
    if step == total_steps:
        return True
    return every_n_steps is not None and step % every_n_steps == 0


def should_checkpoint(step: int, *, total_steps: int, every_n_steps: int) -> bool:
    """Whether to write a periodic checkpoint after optimizer step ``step`` (1-based).

    Every ``every_n_steps`` steps, except the last step: the end of training always
    checkpoints it (once, whatever the cadence), before the adapter is exported.
    """
    return step % every_n_steps == 0 and step < total_steps


def epoch_of_step(cursor_after: DataCursor) -> int:
    """The 0-based epoch of the step that left the data at ``cursor_after``.

    A step belongs to the epoch its last row came from. The loader moves the cursor to
    ``(epoch + 1, 0)`` as soon as an epoch's last row is read, so the step that finishes
    epoch ``e`` reports ``e``, not ``e + 1``. A step count alone cannot say this: with
    packing, epochs differ in length by a row or so.
    """
    if cursor_after.position == 0 and cursor_after.epoch > 0:
        return cursor_after.epoch - 1
    return cursor_after.epoch


def check_finite(step: int, loss: float, grad_norm: float | None) -> None:
    """UserError ``nan_loss`` if optimizer step ``step`` (1-based) gave a non-finite
    loss or gradient norm."""
    finite_norm = grad_norm is None or math.isfinite(grad_norm)
    if math.isfinite(loss) and finite_norm:
        return
    raise UserError(
        f"the loss is {loss} (gradient norm {grad_norm}) at step {step}; lower the learning "
        "rate, or check the model's weights and the data",
        code="nan_loss",
    )


def metric_row(
    *,
    step: int,
    total_steps: int,
    cursor_after: DataCursor,
    train_loss: float,
    learning_rate: float,
    grad_norm: float | None,
    step_tokens: int,
    elapsed_s: float,
    tokens_seen: int,
    memory_bytes: int | None,
    evaluation: dict[str, float] | None = None,
    rewards: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The metric item of one optimizer step, keys :data:`METRIC_KEYS` (then, for DPO, the
    reward keys).

    Args:
        step: the 1-based step just taken.
        cursor_after: the data cursor after the step (gives the epoch).
        step_tokens: non-padding tokens the step consumed (all ranks).
        elapsed_s: wall time of the step; ``tokens_per_s`` is None if it is not positive.
        tokens_seen: tokens consumed since the start of training, this step included.
        evaluation: ``valid_loss`` and ``token_accuracy`` (DPO: also ``valid_rewards/*``;
            reinforcement: ``valid_reward_mean``) when the step evaluated; None otherwise
            (all reported as None).
        rewards: a DPO step's ``rewards/*`` or a reinforcement step's
            ``REINFORCEMENT_KEYS`` and ``GRADING_KEYS``; None for supervised steps (no
            reward keys).
    """
    evaluation = evaluation or {}
    row = {
        "step": step,
        "total_steps": total_steps,
        "epoch": epoch_of_step(cursor_after),
        "train_loss": train_loss,
        "learning_rate": learning_rate,
        "grad_norm": grad_norm,
        "tokens_per_s": step_tokens / elapsed_s if elapsed_s > 0 else None,
        "tokens_seen": tokens_seen,
        "memory_bytes": memory_bytes,
        **{k: evaluation.get(k) for k in EVAL_KEYS},
        "time": time.time(),
    }
    if rewards is not None:
        keys, valid_keys = _method_keys(rewards)
        row.update({k: rewards.get(k) for k in keys})
        if keys is REINFORCEMENT_KEYS:
            row.update({k: rewards.get(k) for k in GRADING_KEYS})
        row.update({k: evaluation.get(k) for k in valid_keys})
    return row


def checkpoint_metrics(row: dict[str, Any], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics a checkpoint records: the step's train loss (and DPO or reinforcement
    rewards) and the latest evaluation (from ``previous``, the last checkpoint-metrics dict,
    when this step did not evaluate)."""
    out = {"train_loss": row.get("train_loss")}
    valid_keys: tuple[str, ...] = ()
    if REWARD_KEYS[0] in row or REINFORCEMENT_KEYS[0] in row:
        keys, valid_keys = _method_keys(row)
        out.update({k: row[k] for k in keys})
    eval_keys = EVAL_KEYS + valid_keys
    evaluated = any(row.get(k) is not None for k in ("valid_loss", *valid_keys))
    source = row if evaluated else (previous or {})
    out.update({k: source.get(k) for k in eval_keys})
    return out
