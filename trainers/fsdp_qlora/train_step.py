"""One optimizer step of data-parallel LoRA training (split, accumulate, reduce, clip,
update) and the evaluation pass.

The loss of a step is the mean token cross-entropy over ALL label tokens of the global
batch (every rank's micro-batches together), so the update does not depend on how the
batch is split over ranks and micro-steps: 2 processes x 2 micro-steps compute the same
gradient as 1 process x 4 micro-steps (tested to 1e-5 in fp32). To get there each
micro-step back-propagates ``sum(token losses) * world / global_label_tokens`` (FSDP
averages gradients over ranks, hence the ``world`` factor), with gradient sync and
resharding switched off on all but the last micro-step (``no_sync`` semantics).

Randomness (LoRA dropout) is reseeded from (seed, step, rank) at every step, so a
resumed run draws exactly what the uninterrupted run drew, with no RNG state to save.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from trainers.common.preference import RewardSums, pair_halves
from trainers.common.reinforcement import GradingSummary
from trainers.fsdp_qlora.distributed import (
    DistContext,
    all_reduce_sum,
    clip_grad_norm,
    set_gradient_sync,
)

IGNORE_INDEX = -100


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step measured (global over ranks)."""

    loss: float
    grad_norm: float
    label_tokens: int
    tokens: int
    rewards: dict[str, float] | None = None  # DPO: rewards/chosen, .../rejected, .../accuracy, .../margin
    grading: GradingSummary | None = None  # reinforcement: what the step's grading said besides its rewards


def rank_share(micro_batches: Sequence[Any], ctx: DistContext) -> list[Any]:
    """This rank's micro-batches of a step: a contiguous block of ``len / world`` of them.

    The caller reads the step's ``batch_size / micro_batch_size`` micro-batches in the
    global (seeded, resumable) order on every rank and keeps its block; which rank gets
    which rows does not change the update (the loss is normalized globally).
    """
    n = len(micro_batches)
    if n % ctx.world_size:
        raise ValueError(f"{n} micro-batches cannot be split over {ctx.world_size} ranks")
    per_rank = n // ctx.world_size
    return list(micro_batches[ctx.rank * per_rank : (ctx.rank + 1) * per_rank])


def model_inputs(batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors for a Hugging Face causal LM from a :class:`trainers.common.data.Batch`.

    Unpacked rows use the 2-D padding mask; packed rows (several segments in a row) get a
    4-D block-diagonal causal mask (True = may attend) so examples never see each other.
    """
    input_ids = torch.as_tensor(batch.input_ids, device=device)
    position_ids = torch.as_tensor(batch.position_ids, device=device)
    if int(np.max(batch.segment_ids, initial=0)) > 1:
        from trainers.common.data import block_causal_mask

        mask = torch.as_tensor(block_causal_mask(batch.segment_ids), device=device)
    else:
        mask = torch.as_tensor(batch.attention_mask, device=device)
    # use_cache=False: a KV cache is useless in training and, with activation
    # checkpointing, the recomputed layer would append its keys to it a second time.
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}


def token_loss_sum(model: nn.Module, batch: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropy over label tokens, number of label tokens).

    Only the positions that predict a label token go through ``lm_head`` (transformers'
    boolean ``logits_to_keep``): with completion-only labels the prompt's positions, and
    padding, never produce a vocabulary-sized logit row. Same loss, less compute and
    memory (at seq 2048 and a 128k vocabulary full fp32 logits are 1 GiB per row).
    """
    labels = torch.as_tensor(batch.labels, device=device)
    targets = labels[:, 1:]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = targets != IGNORE_INDEX  # position t predicts token t + 1
    n_labels = int(keep.sum())
    if n_labels == 0:
        # Nothing to learn in this micro-batch; still run the forward so every FSDP rank
        # issues the same collectives, and make the loss an exact zero.
        logits = model(**model_inputs(batch, device), logits_to_keep=1).logits
        return logits.float().sum() * 0.0, 0
    logits = model(**model_inputs(batch, device), logits_to_keep=keep).logits  # (n_labels, vocab)
    loss = LabelCrossEntropySum.apply(logits, targets[keep[:, :-1]])
    return loss, n_labels


class LabelCrossEntropySum(torch.autograd.Function):
    """``sum_i (logsumexp(z_i) - z_i[t_i])`` over rows ``z_i`` of logits (targets all valid).

    The same value as ``F.cross_entropy(z.float(), t, reduction="sum")`` (to fp32 rounding),
    computed in fewer passes over the (label rows x vocabulary) matrix, which is the
    largest tensor of a step at a real vocabulary (32k-128k columns): the forward keeps
    no fp32 log-softmax copy (only the logits, bf16 under bf16 compute, and one
    logsumexp per row), and the backward
    writes ``softmax - one_hot`` in one buffer instead of filling a zero gradient,
    scattering into it and running log-softmax's backward over it.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nll, lse = _label_nll(logits, targets)
        ctx.save_for_backward(logits, lse, targets)
        return nll.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, targets = ctx.saved_tensors
        return _softmax_minus_one_hot(logits, lse, targets).mul_(grad_loss).to(logits.dtype), None


class LabelCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(z_i) - z_i[t_i]`` (shape ``(rows,)``), with the same memory-lean
    forward and backward as :class:`LabelCrossEntropySum`: DPO needs each sequence's own
    log-prob, so the token losses are summed per sequence by the caller."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nll, lse = _label_nll(logits, targets)
        ctx.save_for_backward(logits, lse, targets)
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, targets = ctx.saved_tensors
        return _softmax_minus_one_hot(logits, lse, targets).mul_(grad_nll[:, None]).to(logits.dtype), None


def _label_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    return lse - z.gather(1, targets[:, None]).squeeze(1), lse


def _softmax_minus_one_hot(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # softmax, in ONE fresh fp32 buffer (the saved logits stay intact for retain_graph)
    grad = logits.to(torch.float32, copy=True).sub_(lse[:, None]).exp_()
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0
    return grad


def sequence_log_probs(model: nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
    """Each row's summed log-prob of its label tokens, shape ``(rows,)`` (0 for a row
    without labels). Only label positions go through ``lm_head``, as in
    :func:`token_loss_sum`."""
    labels = torch.as_tensor(batch.labels, device=device)
    targets = labels[:, 1:]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = targets != IGNORE_INDEX
    if not bool(keep.any()):
        logits = model(**model_inputs(batch, device), logits_to_keep=1).logits
        return logits.float().sum() * torch.zeros(labels.shape[0], device=device)
    logits = model(**model_inputs(batch, device), logits_to_keep=keep).logits  # (n_labels, vocab)
    nll = LabelCrossEntropy.apply(logits, targets[keep[:, :-1]])
    rows = keep.nonzero()[:, 0]  # row-major, the order of the kept logits
    return torch.zeros(labels.shape[0], device=device, dtype=nll.dtype).index_add(0, rows, -nll)


@contextmanager
def trained_adapter_disabled(model: nn.Module) -> Iterator[None]:
    """The model without the adapter being trained: DPO's (and GRPO's KL) reference policy.
    That is the base model, or for a job that continues a fine-tuned model the base with
    the parent's frozen adapter: the model the job started from.

    Sets peft's per-layer active adapters directly instead of ``PeftModel.disable_adapter()``,
    which also toggles ``requires_grad`` of the adapter parameters; under FSDP2 those are
    the sharded DTensor parameters whose gradient hooks must stay as they are.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    from trainers.fsdp_qlora.loading import TRAINED_ADAPTER

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [a for a in m.active_adapters if a != TRAINED_ADAPTER]
    try:
        with warnings.catch_warnings():
            # Reentrant activation checkpointing warns that no input needs a gradient: the
            # reference forward runs under no_grad, where none is wanted.
            warnings.filterwarnings("ignore", message="None of the inputs have requires_grad", category=UserWarning)
            yield
    finally:
        for m, b in zip(layers, before, strict=True):
            m._active_adapter = b


def reseed(seed: int, step: int, ctx: DistContext) -> None:
    """Per-(seed, step, rank) torch RNG: dropout masks are reproducible across resumes."""
    torch.manual_seed((seed * 1_000_003 + step) * 4_099 + ctx.rank)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    ctx: DistContext,
    *,
    step: int,
    seed: int,
    learning_rate: float,
    max_grad_norm: float | None,
) -> StepStats:
    """Run one optimizer step on this rank's ``micro_batches`` (see :func:`rank_share`).

    All ranks must call it with the same number of micro-batches (FSDP collectives).
    """
    if not micro_batches:
        raise ValueError("a step needs at least one micro-batch")
    reseed(seed, step, ctx)
    local_labels = sum(int((np.asarray(b.labels)[:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
    local_tokens = sum(int(np.asarray(b.attention_mask).sum()) for b in micro_batches)
    global_labels, global_tokens = (int(v) for v in all_reduce_sum([local_labels, local_tokens], ctx))
    if global_labels == 0:
        raise ValueError("the step's batch has no label tokens")
    scale = ctx.world_size / global_labels
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        set_gradient_sync(model, last)
        loss, _ = token_loss_sum(model, batch, ctx.device)
        (loss * scale).backward()
        loss_sum += float(loss.detach())
    set_gradient_sync(model, True)
    (total_loss,) = all_reduce_sum([loss_sum], ctx)
    return StepStats(
        loss=total_loss / global_labels,
        grad_norm=_update(model, optimizer, learning_rate, max_grad_norm),
        label_tokens=global_labels,
        tokens=global_tokens,
    )


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, learning_rate: float,
            max_grad_norm: float | None) -> float:
    """Clip the accumulated gradients, AdamW-step at ``learning_rate``; the norm before clipping."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(trainable, max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass(frozen=True)
class PreferenceObjective:
    """DPO's settings: ``beta`` of the sigmoid loss, ``sft_weight`` of the chosen answers' NLL."""

    beta: float
    sft_weight: float = 0.0


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """Per-pair DPO sigmoid loss and rewards from ``(2k,)`` sequence log-probs (chosen first).

    ``loss = -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``; the rewards are
    ``beta * (pi - ref)`` of each answer (detached).
    """
    k = policy.shape[0] // 2
    chosen_ratio = policy[:k] - reference[:k]
    rejected_ratio = policy[k:] - reference[k:]
    loss = -torch.nn.functional.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def _reward_sums(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> RewardSums:
    return RewardSums(pairs=float(loss.shape[0]), loss=float(loss.detach().sum()), chosen=float(chosen.sum()),
                      rejected=float(rejected.sum()), correct=float((chosen > rejected).sum()))


def preference_backward(
    model: nn.Module, micro_batches: Sequence[Any], ctx: DistContext, objective: PreferenceObjective
) -> tuple[float, RewardSums, int, int]:
    """Back-propagate the step's DPO objective over this rank's preference micro-batches.

    The objective is ``mean over the step's pairs of the DPO loss + sft_weight x mean over
    its chosen answer tokens of their NLL`` (TRL's ``loss_type=["sigmoid", "sft"]``), both
    means global over ranks and micro-batches, so the gradient does not depend on the
    split. Each micro-batch runs the reference forward (adapter off, no grad) and then the
    policy forward and backward on the same ``2k`` rows.

    Returns:
        The objective's value, the step's reward sums (``loss``: the DPO loss alone), its
        label tokens and non-padding tokens, all global over ranks.
    """
    local = [0.0, 0.0, 0.0, 0.0]  # pairs, chosen label tokens, label tokens, tokens
    for b in micro_batches:
        chosen, _ = pair_halves(b)
        local = [local[0] + b.input_ids.shape[0] // 2, local[1] + chosen.n_label_tokens,
                 local[2] + b.n_label_tokens, local[3] + b.n_tokens]
    pairs, chosen_tokens, labels, tokens = (int(v) for v in all_reduce_sum(local, ctx))
    if pairs == 0 or chosen_tokens == 0:
        raise ValueError("the step's batch has no preference pair with a trained token")
    sums = RewardSums()
    sft_total = 0.0
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        with torch.no_grad(), trained_adapter_disabled(model):
            reference = sequence_log_probs(model, batch, ctx.device)
        policy = sequence_log_probs(model, batch, ctx.device)
        loss, chosen_reward, rejected_reward = dpo_terms(policy, reference, objective.beta)
        chosen_nll = -policy[: loss.shape[0]].sum()
        micro = loss.sum() / pairs
        if objective.sft_weight:
            micro = micro + objective.sft_weight * chosen_nll / chosen_tokens
        (micro * ctx.world_size).backward()
        sums = sums + _reward_sums(loss, chosen_reward, rejected_reward)
        sft_total += float(chosen_nll.detach())
    set_gradient_sync(model, True)
    reduced = all_reduce_sum([*sums.as_list(), sft_total], ctx)
    sums = RewardSums.from_list(reduced[:5])
    value = sums.loss / pairs + objective.sft_weight * reduced[5] / chosen_tokens
    return value, sums, labels, tokens


def dpo_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    ctx: DistContext,
    objective: PreferenceObjective,
    *,
    step: int,
    seed: int,
    learning_rate: float,
    max_grad_norm: float | None,
) -> StepStats:
    """One DPO optimizer step on this rank's preference micro-batches (see :func:`train_step`)."""
    if not micro_batches:
        raise ValueError("a step needs at least one micro-batch")
    reseed(seed, step, ctx)
    value, sums, labels, tokens = preference_backward(model, micro_batches, ctx, objective)
    return StepStats(
        loss=value,
        grad_norm=_update(model, optimizer, learning_rate, max_grad_norm),
        label_tokens=labels,
        tokens=tokens,
        rewards=sums.metrics(),
    )


def build_optimizer(model: nn.Module, *, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable (LoRA) parameters only; frozen bases carry no state."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (LoRA was not injected?)")
    # On a GPU, the multi-tensor (foreach) AdamW, as torch's default there: a LoRA of all 7
    # projections of an 8B model is 448 tensors, and the per-tensor loop launches ~10
    # kernels for each while the GPU, just synchronized by the gradient-norm read, sits
    # idle (one H200: 0.88x the tokens/s of transformers + peft with torch's default AdamW
    # before, 1.06x after; bench/RESULTS.md, "jax_lora and fsdp_qlora on one H200"). On CPU
    # the per-tensor loop: the foreach kernels group tensors by device/dtype and do not mix
    # DTensors with different placements well there. The same AdamW formula either way.
    foreach = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=foreach)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's (zero) state for every parameter so a checkpoint can be loaded
    into it in place (torch creates optimizer state lazily on the first step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off and no grad, but quantized layers left in train mode: an eval-mode
    bitsandbytes ``Linear4bit`` repacks its weight in place on avx512_bf16 CPUs, which
    under FSDP would corrupt the all-gathered copy's layout bookkeeping."""
    from trainers.fsdp_qlora.quantize import is_quantized_linear

    changed = [m for m in model.modules() if m.training and not is_quantized_linear(m)]
    for m in changed:
        m.training = False
    try:
        with torch.no_grad():
            yield
    finally:
        for m in changed:
            m.training = True


def evaluate(model: nn.Module, data: Any, ctx: DistContext, max_batches: int | None) -> dict[str, float]:
    """Mean token loss and accuracy on validation (every rank runs the same batches: the
    FSDP all-gathers of each forward are collectives)."""
    loss_sum, correct, count = 0.0, 0, 0
    batches = data.micro_batches()
    with evaluation_mode(model):
        for _ in range(min(data.micro_batches_per_epoch(0), max_batches or 1 << 30)):
            batch = next(batches)
            logits = model(**model_inputs(batch, ctx.device)).logits[:, :-1].float()
            labels = torch.as_tensor(batch.labels[:, 1:], device=ctx.device)
            mask = labels != IGNORE_INDEX
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum"))
            correct += int(((logits.argmax(-1) == labels) & mask).sum())
            count += int(mask.sum())
    return {"valid_loss": loss_sum / max(count, 1), "token_accuracy": correct / max(count, 1)}


def evaluate_preference(model: nn.Module, data: Any, ctx: DistContext, max_batches: int | None,
                        objective: PreferenceObjective) -> dict[str, float]:
    """DPO loss and rewards on the validation pairs: ``valid_loss`` (the same objective as
    ``train_loss``) and ``valid_rewards/*`` (every rank runs the same batches)."""
    sums, sft_sum, chosen_tokens = RewardSums(), 0.0, 0
    batches = data.micro_batches()
    with evaluation_mode(model):
        for _ in range(min(data.micro_batches_per_epoch(0), max_batches or 1 << 30)):
            batch = next(batches)
            with trained_adapter_disabled(model):
                reference = sequence_log_probs(model, batch, ctx.device)
            policy = sequence_log_probs(model, batch, ctx.device)
            loss, chosen, rejected = dpo_terms(policy, reference, objective.beta)
            sums = sums + _reward_sums(loss, chosen, rejected)
            sft_sum -= float(policy[: loss.shape[0]].sum())
            chosen_tokens += pair_halves(batch)[0].n_label_tokens
    value = sums.loss / max(sums.pairs, 1.0) + objective.sft_weight * sft_sum / max(chosen_tokens, 1)
    return {"valid_loss": value, "token_accuracy": None, **sums.metrics("valid_")}
