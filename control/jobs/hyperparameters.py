"""Resolving OpenAI's ``"auto"`` hyperparameters to concrete numbers (a pure function).

The rule, from the number of training examples ``n`` (known once the training file is
validated):

- ``n_epochs`` = 3, raised so at least 100 examples are seen (``ceil(100 / n)``, at most
  25) and lowered so at most 25,000 are seen (``floor(25000 / n)``, at least 1).
- ``batch_size`` = the power of two nearest to 0.2 % of ``n``, between 1 and 256, and
  never more than ``n`` (one optimizer step per ``batch_size`` examples).
- ``learning_rate_multiplier`` = 1.0. The learning rate is ``2e-4 x multiplier`` for
  LoRA/QLoRA (the usual LoRA rate; OpenAI's multiplier scales a base rate the same way).
  ``learning_rate`` may also be given directly (an extension), which wins.
- ``micro_batch_size`` = the largest divisor of ``batch_size`` that is <= 4 (the rest is
  gradient accumulation; the placement may lower it further).
- ``total_steps`` = ``ceil(n / batch_size) x n_epochs`` (or ``max_steps`` when set);
  ``warmup_steps`` = 3 % of it (rounded) unless given; the scheduler, weight decay and
  gradient clipping the trainer contract's defaults (``trainers.spec``: ``cosine``, 0.0,
  1.0), read through ``control.job_settings``.

A DPO job (``method.type`` "dpo") resolves the same way, an example being one preference
pair (its preferred and its rejected answer are trained in the same micro batch), plus:

- ``beta`` = 0.1 (OpenAI's and TRL's default); ``sft_weight`` = 0.0 (no supervised term):
  the trainer contract's ``MethodSpec`` defaults.

A reinforcement job (``method.type`` "reinforcement") resolves the same way, an example
being one prompt (its sampled completions are trained in the same step), plus:

- ``compute_multiplier`` = 1.0, i.e. 4 completions sampled per prompt
  (``control.job_settings.samples_per_prompt``);
- ``eval_interval`` = a tenth of ``total_steps`` (at least 1): about ten evaluations a run;
- ``eval_samples`` = 1 completion per validation prompt at each evaluation;
- ``reasoning_effort`` = "default"; ``kl_coef``, ``clip_epsilon`` and
  ``max_completion_tokens``: the trainer contract's ``ReinforcementSpec`` defaults (0.0,
  0.2, 1024).

A value the user gave is kept as given. The resolved values are stored on the job and
shown in ``hyperparameters``; the trainer spec is built from them (no "auto" reaches a
trainer).
"""

from __future__ import annotations

import math
from typing import Any

from control.job_settings import DpoMethod, HyperparameterSettings, JobSettings, ReinforcementMethod
from trainers.spec import MethodSpec

BASE_LEARNING_RATE = 2e-4
MIN_EXAMPLES_SEEN = 100
MAX_EXAMPLES_SEEN = 25_000
DEFAULT_EPOCHS = 3
DEFAULT_DPO_BETA = MethodSpec().beta
DEFAULT_COMPUTE_MULTIPLIER = 1.0
DEFAULT_EVAL_SAMPLES = 1
EVALS_PER_RUN = 10
_REINFORCEMENT = ReinforcementMethod()
# What a hyperparameter that the auto rule leaves alone is when not given.
_NOT_GIVEN = HyperparameterSettings()


def auto_n_epochs(n_examples: int) -> int:
    n = max(1, n_examples)
    if n * DEFAULT_EPOCHS < MIN_EXAMPLES_SEEN:
        return min(25, math.ceil(MIN_EXAMPLES_SEEN / n))
    if n * DEFAULT_EPOCHS > MAX_EXAMPLES_SEEN:
        return max(1, MAX_EXAMPLES_SEEN // n)
    return DEFAULT_EPOCHS


def auto_batch_size(n_examples: int) -> int:
    target = max(1.0, 0.002 * n_examples)
    size = 2 ** round(math.log2(target))
    return int(max(1, min(256, size, max(1, n_examples))))


def micro_batch_for(batch_size: int, limit: int = 4) -> int:
    return max(d for d in range(1, min(batch_size, limit) + 1) if batch_size % d == 0)


def resolve_hyperparameters(requested: dict[str, Any], n_examples: int, *,
                            method: str = "supervised") -> dict[str, Any]:
    """Concrete hyperparameters for ``requested`` (values or "auto") and ``n_examples``.

    Args:
        requested: the job's hyperparameters as validated by the API schema.
        n_examples: examples in the training file (preference pairs for DPO, prompts for
            reinforcement).
        method: the job's ``method.type``: ``supervised``, ``dpo`` or ``reinforcement``.

    Returns:
        A dict with n_epochs, batch_size, learning_rate_multiplier, learning_rate,
        micro_batch_size, lr_scheduler, warmup_steps, weight_decay, max_grad_norm,
        max_steps and total_steps, all concrete; for DPO also beta and sft_weight; for
        reinforcement also the names of ``ReinforcementMethod.HYPERPARAMETERS``.
    """
    def given(name: str) -> Any:
        value = requested.get(name)
        return None if value in (None, "auto") else value

    n_epochs = given("n_epochs") or auto_n_epochs(n_examples)
    batch_size = given("batch_size") or auto_batch_size(n_examples)
    multiplier = given("learning_rate_multiplier") or 1.0
    learning_rate = given("learning_rate") or BASE_LEARNING_RATE * multiplier
    steps_per_epoch = math.ceil(max(1, n_examples) / batch_size)
    max_steps = given("max_steps")
    total_steps = max_steps or steps_per_epoch * n_epochs
    warmup = requested.get("warmup_steps")
    preference = (
        {"beta": float(given("beta") or DEFAULT_DPO_BETA),
         "sft_weight": float(requested.get("sft_weight") or DpoMethod().sft_weight)}
        if method == "dpo" else {}
    )
    reinforcement = (
        {"compute_multiplier": float(given("compute_multiplier") or DEFAULT_COMPUTE_MULTIPLIER),
         "eval_interval": int(given("eval_interval") or max(1, total_steps // EVALS_PER_RUN)),
         "eval_samples": int(given("eval_samples") or DEFAULT_EVAL_SAMPLES),
         "reasoning_effort": requested.get("reasoning_effort") or _REINFORCEMENT.reasoning_effort,
         "kl_coef": float(_REINFORCEMENT.kl_coef if requested.get("kl_coef") is None else requested["kl_coef"]),
         "clip_epsilon": float(requested.get("clip_epsilon") or _REINFORCEMENT.clip_epsilon),
         "max_completion_tokens": int(requested.get("max_completion_tokens")
                                      or _REINFORCEMENT.max_completion_tokens)}
        if method == "reinforcement" else {}
    )
    return {
        **preference,
        **reinforcement,
        "n_epochs": int(n_epochs),
        "batch_size": int(batch_size),
        "learning_rate_multiplier": float(multiplier),
        "learning_rate": float(learning_rate),
        "micro_batch_size": int(given("micro_batch_size") or micro_batch_for(batch_size)),
        "lr_scheduler": requested.get("lr_scheduler") or _NOT_GIVEN.lr_scheduler,
        "warmup_steps": int(warmup if warmup is not None else round(0.03 * total_steps)),
        "weight_decay": float(requested.get("weight_decay") or _NOT_GIVEN.weight_decay),
        "max_grad_norm": requested.get("max_grad_norm", _NOT_GIVEN.max_grad_norm),
        "max_steps": max_steps,
        "total_steps": int(total_steps),
    }


def resolve_settings(settings: JobSettings, n_examples: int) -> JobSettings:
    """``settings`` with their hyperparameters resolved for ``n_examples`` (what the row of
    a job with these settings stores once its training file is validated)."""
    resolved = resolve_hyperparameters(settings.stored_hyperparameters(), n_examples,
                                       method=settings.method.type)
    return settings.with_hyperparameters(resolved)
