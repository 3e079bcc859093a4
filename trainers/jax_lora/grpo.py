"""GRPO on the JAX trainer: the loss in ``jax.numpy`` and a step's sampled batch.

A reinforcement step (``recipe.py``) runs what ``trainers/fsdp_qlora/grpo_step.py`` runs
on the torch trainer, with the framework-free parts shared through
``trainers.common.reinforcement`` (grading, group advantages, metrics, the draws' seed):

1. **sample** ``samples_per_prompt`` completions of each of the step's prompts from the
   current policy (``sampling.Sampler``: the whole step's rows in one jitted decode loop
   on the job's mesh, the adapter on, no dropout, the job's temperature);
2. **grade** them (:func:`sample_and_grade`; with several processes, process 0 grades
   and the rewards are broadcast, so every process builds the same batch even if a
   python grader's time limit hits on one host only; process 0, which reports, keeps the
   grading's summary: ``sub_rewards`` and ``grader_errors``);
3. **advantages** per group (``trainers.common.reinforcement.group_advantages``);
4. **one update** on the rows ``prompt + completion`` (:func:`grpo_batch`), in the
   step's layout (accum, dp x micro_batch_size x samples_per_prompt, seq): a micro-batch
   holds whole groups, its rows split over the data-parallel devices like any batch.
   ``step.make_grpo_loss_and_grads`` takes the completion tokens' log-probs under the
   policy (the logits divided by the sampling temperature, dropout as trained) and, with
   ``kl_coef`` > 0, under the reference (the same base with no adapter, ``lora=None``,
   as the DPO reference), then :func:`grpo_token_loss`.

:func:`grpo_token_loss` is ``trainers.common.grpo.grpo_loss`` (itself TRL's
``GRPOTrainer._compute_loss``) written in ``jax.numpy``: the same clipped ratio, k3 KL
and ``grpo``/``bnpo``/``dr_grpo``/``dapo`` averaging; ``tests/trainers/jax_lora/
test_grpo_parity.py`` compares its loss, gradient and sums with the torch function's and
a whole JAX step's with the torch trainer's. The old log-probs are the policy's own,
under ``stop_gradient`` (one update per sampled batch: ratio 1, TRL's ``num_iterations=1``).
The loss reads log-probs, masks and advantages at the positions of ``loss.token_losses``
(position ``t`` scores token ``t + 1``), so no completion is re-aligned to the left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainers.common.data import IGNORE_INDEX
from trainers.common.reinforcement import GradingSummary, GrpoObjective, Prompt, grade_completions

# What the compiled step returns besides the loss and gradient norm (sums over the step).
GRPO_SUM_KEYS = ("kl_sum", "clipped", "completion_tokens")


@dataclass(frozen=True)
class ReinforcementLoss:
    """GRPO's static settings in ``step.StepConfig`` (hashable: part of the jit key)."""

    kl_coef: float
    clip_epsilon: float
    loss_type: str = "grpo"
    temperature: float = 1.0
    max_completion_tokens: int = 1024


def reinforcement_loss(objective: GrpoObjective) -> ReinforcementLoss:
    """The step's GRPO settings from the job's objective."""
    return ReinforcementLoss(kl_coef=objective.kl_coef, clip_epsilon=objective.clip_epsilon,
                             loss_type=objective.loss_type, temperature=objective.temperature,
                             max_completion_tokens=objective.max_completion_tokens)


def grpo_token_loss(
    logps: jax.Array,
    old_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logps: jax.Array | None = None,
    kl_coef: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    num_items: jax.Array | float | None = None,
    accumulation: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's loss on one micro-batch and its sums (``trainers.common.grpo.grpo_loss``'s
    arguments and averaging, in ``jax.numpy``).

    Args:
        logps: ``(B, T)`` log-probs of the sampled tokens under the policy being trained.
        old_logps: ``(B, T)`` under the policy that sampled them; None = ``logps`` under
            ``stop_gradient`` (trained once, right after sampling).
        advantages: ``(B,)`` per completion or ``(B, T)`` per token.
        mask: ``(B, T)`` 1 (or True) for the completion tokens that count.
        ref_logps: ``(B, T)`` under the reference; needed when ``kl_coef`` > 0.
        num_items: ``dapo``'s normalizer, the step's completion tokens (default: this
            micro-batch's).
        accumulation: micro-batches per optimizer step.

    Returns:
        The scalar loss and, without gradient, ``kl_sum`` (the per-token KL summed over
        the masked tokens; 0 without a reference), ``clipped`` (masked tokens whose ratio
        was clipped, below with a negative advantage or above with a positive one) and
        ``completion_tokens``.
    """
    if epsilon_high is None:
        epsilon_high = epsilon_low
    mask = mask.astype(logps.dtype)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    ratio = jnp.exp(logps - old)
    clipped_ratio = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    kl = jnp.zeros_like(per_token)
    if kl_coef != 0.0:
        if ref_logps is None:
            raise ValueError("kl_coef > 0 needs ref_logps")
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl

    masked = per_token * mask
    if loss_type == "grpo":
        loss = jnp.mean(masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)) / accumulation
    elif loss_type == "bnpo":
        loss = masked.sum() / jnp.maximum(mask.sum(), 1.0) / accumulation
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = masked.sum() / (per_token.shape[0] * max_completion_length) / accumulation
    elif loss_type == "dapo":
        tokens = mask.sum() if num_items is None else jnp.asarray(num_items, per_token.dtype)
        loss = masked.sum() / jnp.maximum(tokens, 1.0)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    clipped = (((ratio < 1 - epsilon_low) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0)))
    sums = jax.lax.stop_gradient({
        "kl_sum": jnp.sum(kl * mask),
        "clipped": jnp.sum(clipped.astype(mask.dtype) * mask),
        "completion_tokens": mask.sum(),
    })
    return loss, sums


@dataclass
class Sampled:
    """A step's (or an evaluation's) completions: each with its prompt (one prompt's
    completions contiguous) and its reward, and the grading's summary where this process
    graded (process 0; None on the others, which report nothing)."""

    prompts: list[Prompt]
    completions: list[list[int]]
    rewards: np.ndarray
    grading: GradingSummary | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def sample_and_grade(sampler: Any, params: Any, lora: Any, prompts: Sequence[Prompt], objective: GrpoObjective,
                     n: int, *, seed: int, greedy: bool = False) -> Sampled:
    """``n`` completions of each prompt from ``sampler`` (``sampling.Sampler``), graded.

    Every process samples (the decode loop is one SPMD program); process 0 grades and
    its rewards are broadcast, so all processes train on the same advantages.
    """
    completions = sampler.sample(params, lora, prompts, n, seed=seed, greedy=greedy,
                                 temperature=objective.temperature)
    flat = [p for p in prompts for _ in range(n)]
    grading = None
    if jax.process_index() == 0:
        rewards, grading = grade_completions(objective, completions, [p.item for p in flat])
    else:
        rewards = np.zeros(len(flat), np.float32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        rewards = np.asarray(multihost_utils.broadcast_one_to_all(rewards))
    return Sampled(flat, completions, rewards, grading)


def grpo_batch(sampled: Sampled, advantages: np.ndarray, *, accumulation: int, row_len: int,
               pad_id: int) -> dict[str, np.ndarray]:
    """The step's rows ``prompt + completion``, right-padded to ``row_len``, as
    (accumulation, rows / accumulation, row_len) arrays in the step's batch layout.

    ``labels`` are the completion tokens at their positions (-100 elsewhere: the prompt
    and the padding), so the loss counts the completion up to and including its stop
    token, as TRL's completion mask does. ``advantages`` repeats each row's advantage
    along the row: every batch array is (accum, rows, seq) and shards with the rows.
    """
    n = len(sampled.completions)
    if n % accumulation:
        raise ValueError(f"{n} rows do not split into {accumulation} micro-batches")
    ids = np.full((n, row_len), pad_id, dtype=np.int32)
    labels = np.full((n, row_len), IGNORE_INDEX, dtype=np.int32)
    segments = np.zeros((n, row_len), dtype=np.int32)
    for r, (prompt, completion) in enumerate(zip(sampled.prompts, sampled.completions, strict=True)):
        p, c = len(prompt.input_ids), len(completion)
        if p + c > row_len:
            raise ValueError(f"row {r} has {p + c} tokens, more than the batch's {row_len}")
        ids[r, : p + c] = list(prompt.input_ids) + list(completion)
        labels[r, p : p + c] = completion
        segments[r, : p + c] = 1
    host = {
        "input_ids": ids,
        "labels": labels,
        "positions": np.broadcast_to(np.arange(row_len, dtype=np.int32), (n, row_len)),
        "segment_ids": segments,
        "advantages": np.broadcast_to(np.asarray(advantages, np.float32)[:, None], (n, row_len)),
    }
    return {k: np.ascontiguousarray(v).reshape(accumulation, n // accumulation, row_len) for k, v in host.items()}


def placeholder_batch(rows: int, *, accumulation: int, row_len: int) -> dict[str, np.ndarray]:
    """A batch of the step's shapes with nothing to train: what the step is compiled (and
    its memory checked) for before anything is sampled."""
    shape = (accumulation, rows // accumulation, row_len)
    zeros = np.zeros(shape, dtype=np.int32)
    return {"input_ids": zeros, "labels": np.full(shape, IGNORE_INDEX, dtype=np.int32), "positions": zeros,
            "segment_ids": zeros, "advantages": np.zeros(shape, dtype=np.float32)}
