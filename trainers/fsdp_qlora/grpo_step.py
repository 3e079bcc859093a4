"""One GRPO optimizer step of reinforcement fine-tuning (sample, grade, score, update) and
the reward evaluation, for the torch trainer on one process.

Per step, on the step's prompts (``trainers.common.reinforcement.PromptData.take``):

1. **sample** ``samples_per_prompt`` completions per prompt from the current policy (the
   adapter on, dropout off, no grad): the prompt's group in one batch with a KV cache, at
   the job's temperature (1 by default) with no top-p/top-k cut, each row stopped at its
   first stop token (the tokenizer's EOS, the model's ``generation_config`` EOS ids and
   the end-of-turn token of common chat templates) or at the prompt's token budget. The
   draws come from a ``torch.Generator`` seeded from (seed, step), so a resumed run samples
   exactly what the uninterrupted run did without saving any generator state (the same
   rule as the dropout masks, ``train_step.reseed``);
2. **grade** each completion's text (special tokens removed) with the job's grader
   (``trainers.common.graders.grade_batch``: ``sample.output_text`` and the line as
   ``item``); a sample the grader cannot score gets reward 0, as OpenAI's graders do (it
   counts in the step's ``grader_errors``, beside a ``multi`` grader's ``sub_rewards``:
   ``trainers.common.reinforcement.GradingSummary``);
3. **advantages** per group (``trainers.common.grpo.group_advantages``);
4. per micro-batch of ``micro_batch_size`` prompts (all their completions), the per-token
   log-probs of the completion tokens under the policy (with grad; dropout as trained),
   and with ``kl_coef`` > 0 under the reference (the same model with the trained LoRA
   switched off, no grad: ``train_step.trained_adapter_disabled``, no second copy of the model);
   the old log-probs are the sampling policy's, i.e. these same values detached, because
   each batch is trained on once right after it is sampled (ratio 1 at the only pass,
   TRL's ``num_iterations=1``), so no extra forward is needed; then
   ``trainers.common.grpo.grpo_loss`` (divided by the micro-batches of the step) and
   backward; then one clipped AdamW update (``train_step._update``).

The completion tokens count in the loss up to and including the stop token, as TRL's
completion mask does. One process only: sampling under FSDP would need every rank to run
the same number of decoding steps in lockstep; the recipe refuses a reinforcement job with
more than one rank (``reinforcement_multi_rank``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from trainers.common.grpo import group_advantages, grpo_loss
from trainers.common.reinforcement import (
    GradingSummary,
    GrpoObjective,
    Prompt,
    cut_at_stop,
    evaluation_metrics,
    grade_completions,
    sampling_seed,
    step_metrics,
)
from trainers.fsdp_qlora.distributed import DistContext
from trainers.fsdp_qlora.train_step import (
    LabelCrossEntropy,
    StepStats,
    _update,
    evaluation_mode,
    reseed,
    trained_adapter_disabled,
)


def sampling_generator(seed: int, step: int, device: torch.device, *, stream: int = 0) -> torch.Generator:
    """The generator of step ``step``'s draws (``stream`` 1: an evaluation's)."""
    return torch.Generator(device=device).manual_seed(sampling_seed(seed, step, stream=stream))


@torch.no_grad()
def sample_group(model: nn.Module, prompt: Prompt, n: int, objective: GrpoObjective, device: torch.device,
                 generator: torch.Generator | None) -> list[list[int]]:
    """``n`` completions of ``prompt`` (token ids, each ending at its stop token if it drew
    one); ``generator`` None = greedy. Call under ``evaluation_mode``."""
    ids = torch.tensor([list(prompt.input_ids)] * n, device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    stop = torch.tensor(sorted(objective.stop_ids), device=device, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    drawn: list[torch.Tensor] = []
    for t in range(prompt.max_new_tokens):
        if generator is None:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / objective.temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token = torch.where(done, torch.full_like(token, objective.pad_id), token)
        drawn.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or t == prompt.max_new_tokens - 1:
            break
        with warnings.catch_warnings():
            # Newer transformers rename the argument (``cache``); this one works on every version.
            warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)
            out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    return [cut_at_stop(row, objective.stop_ids) for row in torch.stack(drawn, dim=1).tolist()]


@dataclass(frozen=True)
class CompletionRows:
    """Prompt + completion rows, right-padded: the tensors of a log-prob forward.

    ``starts[r]`` is where row ``r``'s completion begins, ``completion_mask`` ``(R, T)``
    marks its tokens (``T`` the longest completion).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor  # (R, L) bool: the positions that predict a completion token
    completion_mask: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
                    device: torch.device) -> CompletionRows:
    """The rows of ``prompts[r] + completions[r]`` (see :class:`CompletionRows`)."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    longest = max(len(c) for c in completions)
    n = len(prompts)
    input_ids = np.full((n, length), pad_id, dtype=np.int64)
    attention = np.zeros((n, length), dtype=np.int64)
    keep = np.zeros((n, length), dtype=bool)
    mask = np.zeros((n, longest), dtype=np.float32)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        input_ids[r, : len(p) + len(c)] = list(p) + list(c)
        attention[r, : len(p) + len(c)] = 1
        keep[r, len(p) - 1 : len(p) + len(c) - 1] = True
        mask[r, : len(c)] = 1.0
    positions = np.broadcast_to(np.arange(length), (n, length)).copy()
    arrays = (input_ids, attention, positions, keep, mask)
    return CompletionRows(*(torch.as_tensor(a, device=device) for a in arrays))


def completion_log_probs(model: nn.Module, rows: CompletionRows, temperature: float) -> torch.Tensor:
    """``(R, T)`` log-prob of each completion token (0 past a row's end), with the graph
    when grad is on. Only the positions that predict a completion token go through
    ``lm_head``; the logits are divided by the sampling temperature (as TRL does)."""
    logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids,
                   use_cache=False, logits_to_keep=rows.keep).logits  # (completion tokens, vocab)
    if temperature != 1.0:
        logits = logits / temperature
    targets = rows.input_ids[:, 1:][rows.keep[:, :-1]]
    nll = LabelCrossEntropy.apply(logits, targets)
    out = torch.zeros(rows.completion_mask.shape, device=nll.device, dtype=nll.dtype)
    return out.masked_scatter(rows.completion_mask.bool(), -nll)


@dataclass
class _Sampled:
    prompts: list[Prompt]
    completions: list[list[int]]
    rewards: torch.Tensor
    grading: GradingSummary | None = None


def sample_and_grade(model: nn.Module, prompts: Sequence[Prompt], objective: GrpoObjective, ctx: DistContext,
                     generator: torch.Generator | None, n: int) -> _Sampled:
    """``n`` completions per prompt (rows of one prompt contiguous) and their rewards."""
    completions: list[list[int]] = []
    with evaluation_mode(model):
        for prompt in prompts:
            completions.extend(sample_group(model, prompt, n, objective, ctx.device, generator))
    flat = [p for p in prompts for _ in range(n)]
    rewards, grading = grade_completions(objective, completions, [p.item for p in flat])
    return _Sampled(flat, completions, torch.from_numpy(rewards), grading)


def grpo_backward(model: nn.Module, sampled: _Sampled, objective: GrpoObjective, ctx: DistContext,
                  micro_batch_size: int) -> tuple[float, dict[str, float | None], int, int]:
    """Back-propagate GRPO's loss of the step over its micro-batches.

    Returns:
        The step's loss (the sum of the micro-batches' scaled losses), its metrics
        (``REINFORCEMENT_KEYS`` and ``GRADING_KEYS``), its completion tokens and all its tokens.
    """
    g = objective.samples_per_prompt
    advantages = group_advantages(sampled.rewards, g)
    lengths = [len(c) for c in sampled.completions]
    completion_tokens = sum(lengths)
    rows_per_micro = micro_batch_size * g
    n_micro = math.ceil(len(sampled.completions) / rows_per_micro)
    loss_total, tokens, kl_sum, clip_sum = 0.0, 0, 0.0, 0.0
    for i in range(n_micro):
        sl = slice(i * rows_per_micro, (i + 1) * rows_per_micro)
        rows = completion_rows([p.input_ids for p in sampled.prompts[sl]], sampled.completions[sl],
                               objective.pad_id, ctx.device)
        reference = None
        if objective.kl_coef > 0:
            with torch.no_grad(), trained_adapter_disabled(model):
                reference = completion_log_probs(model, rows, objective.temperature)
        policy = completion_log_probs(model, rows, objective.temperature)
        out = grpo_loss(policy, None, advantages[sl].to(policy.device, policy.dtype), rows.completion_mask,
                        ref_per_token_logps=reference, kl_coef=objective.kl_coef,
                        epsilon_low=objective.clip_epsilon, loss_type=objective.loss_type,  # type: ignore[arg-type]
                        max_completion_length=objective.max_completion_tokens,
                        num_items_in_batch=float(completion_tokens), gradient_accumulation_steps=n_micro,
                        rewards=sampled.rewards[sl])
        out.loss.backward()
        loss_total += out.metrics.loss
        micro_tokens = float(rows.completion_mask.sum())
        kl_sum += (out.metrics.kl or 0.0) * micro_tokens
        clip_sum += out.metrics.clip_fraction * micro_tokens
        tokens += rows.tokens
    metrics = step_metrics(sampled.rewards.numpy(), lengths, kl_sum=kl_sum if objective.kl_coef > 0 else None,
                           clipped_tokens=clip_sum, grading=sampled.grading)
    return loss_total, metrics, completion_tokens, tokens


def grpo_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, prompts: Sequence[Prompt], ctx: DistContext,
                    objective: GrpoObjective, *, step: int, seed: int, micro_batch_size: int, learning_rate: float,
                    max_grad_norm: float | None) -> StepStats:
    """One GRPO optimizer step on ``prompts`` (module doc)."""
    if not prompts:
        raise ValueError("a step needs at least one prompt")
    reseed(seed, step, ctx)
    sampled = sample_and_grade(model, prompts, objective, ctx, sampling_generator(seed, step, ctx.device),
                               objective.samples_per_prompt)
    loss, metrics, completion_tokens, tokens = grpo_backward(model, sampled, objective, ctx, micro_batch_size)
    return StepStats(loss=loss, grad_norm=_update(model, optimizer, learning_rate, max_grad_norm),
                     label_tokens=completion_tokens, tokens=tokens, rewards=metrics,  # type: ignore[arg-type]
                     grading=sampled.grading)


def evaluate_rewards(model: nn.Module, data: Any, ctx: DistContext, max_batches: int | None,
                     objective: GrpoObjective, *, seed: int, step: int) -> dict[str, float | None]:
    """``valid_reward_mean``: the mean reward of the validation prompts' completions, in
    file order (``max_batches`` micro-batches of prompts at most). With ``eval_samples`` 1
    the completion is greedy (deterministic, the policy's most likely answer); with more,
    that many are sampled per prompt at the job's temperature from a generator seeded by
    (seed, step)."""
    samples = objective.eval_samples
    generator = None if samples == 1 else sampling_generator(seed, step, ctx.device, stream=1)
    sampled = sample_and_grade(model, data.evaluation_prompts(max_batches), objective, ctx, generator, samples)
    return evaluation_metrics(sampled.rewards.numpy())
