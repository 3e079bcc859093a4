"""GRPO's objective (Shao et al. 2024, "DeepSeekMath"): group-normalized advantages and the
clipped policy-ratio loss on sampled completions, in PyTorch.

Reinforcement fine-tuning samples ``G`` completions per prompt (``samples_per_prompt``),
scores each with the job's grader, and trains on them:

1. :func:`group_advantages` (``trainers.common.reinforcement``'s, on tensors): each
   completion's reward relative to its own prompt's group,
   ``A = (r - mean_group(r)) / (std_group(r) + eps)`` (``std`` with Bessel's correction,
   ``eps`` = 1e-4), so a prompt every sample solves (or fails) teaches nothing and no
   reward scale needs tuning. The completions of one prompt are contiguous rows.
2. :func:`grpo_loss`: per completion token ``t``, the ratio ``rho = exp(logp - logp_old)``
   of the policy being trained to the policy that sampled, and the PPO-style clipped
   surrogate ``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``; with ``kl_coef``
   > 0 plus ``kl_coef`` times the per-token KL estimate to the reference policy,
   ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3: unbiased and never negative).
   With LoRA the reference is the same base with the adapter disabled. Only completion
   tokens count (``completion_mask``: prompt, padding and anything after the end of
   sequence are 0). ``loss_type`` picks how the token losses are averaged:

   - ``grpo``: mean over each completion's tokens, then over completions (the paper's);
   - ``bnpo``: mean over all completion tokens of the micro-batch;
   - ``dr_grpo``: sum over tokens / (completions x ``max_completion_length``), a constant
     normalizer, so long answers are not favoured (Liu et al. 2025, "Dr. GRPO");
   - ``dapo``: sum over tokens / the completion tokens of the whole optimizer step
     (``num_items_in_batch``; Yu et al. 2025, "DAPO"), token-level like ``bnpo`` but
     normalized once per step rather than per micro-batch.

   The ``grpo``, ``bnpo`` and ``dr_grpo`` losses are divided by the gradient accumulation
   steps, so a step's gradient is the mean over its micro-batches.

This equals TRL's ``GRPOTrainer._compute_loss`` for those loss types with token-level
importance sampling, no off-policy mask, no entropy mask or bonus and no vLLM correction
(``tests/trainers/test_grpo_trl_parity.py`` feeds both the same tensors). The metrics
(:class:`GrpoMetrics`) are the ones a run reports: reward mean and std, the KL to the
reference, the fraction of tokens whose ratio was clipped, the completion length.

Torch only: the fsdp_qlora trainer imports this; the JAX trainer never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.common.reinforcement import ADVANTAGE_EPS
from trainers.common.reinforcement import group_advantages as advantages_of
from trainers.spec import GrpoLossType


def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = ADVANTAGE_EPS,
                     scale: bool = True) -> torch.Tensor:
    """Each completion's advantage within its prompt's group, as a tensor on ``rewards``'
    device: ``trainers.common.reinforcement.group_advantages`` (the one rule both trainers
    apply) on the rewards, which the grader computed on the host."""
    values = advantages_of(rewards.detach().cpu().numpy(), group_size, eps=eps, scale=scale)
    return torch.as_tensor(values, dtype=rewards.dtype, device=rewards.device)


@dataclass(frozen=True)
class GrpoMetrics:
    """What one GRPO micro-batch reports (plain floats, for the reporter).

    ``clip_low`` / ``clip_high``: the fraction of completion tokens whose ratio was clipped
    below (with a negative advantage) or above (with a positive one), the tokens whose
    gradient clipping removed; ``clip_fraction`` is their sum. ``kl`` is None without a
    reference (``kl_coef`` 0).
    """

    loss: float
    reward_mean: float | None
    reward_std: float | None
    kl: float | None
    clip_low: float
    clip_high: float
    clip_fraction: float
    completion_length: float

    def as_dict(self) -> dict[str, float]:
        """The metrics that are set, by name."""
        return {name: value for name, value in self.__dict__.items() if value is not None}


@dataclass(frozen=True)
class GrpoOutput:
    loss: torch.Tensor
    """Scalar, with the graph to ``per_token_logps``: what the step back-propagates."""
    per_token_loss: torch.Tensor
    metrics: GrpoMetrics


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((values * mask).sum() / mask.sum().clamp(min=1.0)).item())


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    ref_per_token_logps: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: GrpoLossType = "grpo",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    rewards: torch.Tensor | None = None,
) -> GrpoOutput:
    """GRPO's loss on one micro-batch of sampled completions (see the module doc).

    Args:
        per_token_logps: ``(B, T)`` log-probs of the sampled completion tokens under the
            policy being trained (with its graph).
        old_per_token_logps: ``(B, T)`` the same under the policy that sampled them; None
            when the batch is trained on once, right after sampling (the ratio is then 1,
            its gradient still the policy gradient).
        advantages: ``(B,)`` per completion (:func:`group_advantages`) or ``(B, T)``.
        completion_mask: ``(B, T)`` 1 for the completion tokens that count, else 0.
        ref_per_token_logps: ``(B, T)`` under the reference policy; needed when
            ``kl_coef`` > 0.
        kl_coef: weight of the KL estimate (TRL's ``beta``).
        epsilon_low, epsilon_high: the clip range ``[1 - low, 1 + high]``; ``epsilon_high``
            None = ``epsilon_low`` (DAPO's "clip higher" sets it larger).
        loss_type: how token losses are averaged (module doc).
        max_completion_length: ``dr_grpo``'s constant normalizer (required for it).
        num_items_in_batch: ``dapo``'s normalizer, the completion tokens of the whole
            optimizer step (default: this micro-batch's).
        gradient_accumulation_steps: micro-batches per optimizer step.
        rewards: ``(B,)`` the completions' rewards, for the metrics only.
    """
    if epsilon_high is None:
        epsilon_high = epsilon_low
    mask = completion_mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

    coef_1 = torch.exp(per_token_logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)

    per_token_kl = None
    if kl_coef != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("kl_coef > 0 needs ref_per_token_logps")
        delta = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(delta) - delta - 1
        per_token_loss = per_token_loss + kl_coef * per_token_kl

    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dapo":
        tokens = mask.sum() if num_items_in_batch is None else torch.as_tensor(
            num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device)
        loss = (per_token_loss * mask).sum() / tokens.clamp(min=1.0)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    with torch.no_grad():
        clipped_low = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype)
        clipped_high = ((coef_1 > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype)
        reward_values = rewards.detach().to(torch.float32) if rewards is not None else None
        metrics = GrpoMetrics(
            loss=float(loss.detach().item()),
            reward_mean=float(reward_values.mean().item()) if reward_values is not None else None,
            reward_std=(float(reward_values.std().item()) if reward_values is not None and reward_values.numel() > 1
                        else None),
            kl=_masked_mean(per_token_kl, mask) if per_token_kl is not None else None,
            clip_low=_masked_mean(clipped_low, mask),
            clip_high=_masked_mean(clipped_high, mask),
            clip_fraction=_masked_mean(torch.maximum(clipped_low, clipped_high), mask),
            completion_length=float(mask.sum(-1).mean().item()),
        )
    return GrpoOutput(loss=loss, per_token_loss=per_token_loss, metrics=metrics)
