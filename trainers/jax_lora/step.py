"""The train state, the optimizer and THE jitted train step (plus the eval step).

One place declares every sharding: ``compile_steps`` jits the train step with explicit
``in_shardings``/``out_shardings`` and donates the state, so the LoRA factors and the
AdamW moments stay sharded like the parameters they belong to and are updated in place.

Loss. Completion-only, as ``trainers.common.data`` labels it: ``labels`` are aligned with
``input_ids`` (HF convention), position t is scored on predicting ``labels[t+1]`` and
``-100`` is ignored. The loss of an optimizer step is the mean over ALL trained tokens of
all its micro-batches (sum of token losses / token count), so gradient accumulation gives
exactly the gradient of the full batch, whatever the padding per micro-batch. The
step never builds the (rows, seq, vocab) logits: ``loss.token_losses`` applies the LM
head to ``loss_chunk`` labelled positions at a time, forward and backward, and skips
the positions with no label (the logits were most of the step's memory at a 128k
vocabulary).

DPO. With ``StepConfig.preference`` set, the step optimizes the DPO sigmoid loss
instead: each micro-batch holds the chosen then the rejected rows of its pairs (per
data-parallel block), the policy forward and a reference forward (the same base weights
with no adapter, ``lora=None``, under ``stop_gradient``) give each
answer's summed completion log-prob, and the objective is the mean pair loss over the
whole batch (+ ``sft_weight`` x the chosen tokens' mean NLL). The reward sums come back
with the metrics.

GRPO. With ``StepConfig.reinforcement`` set, the step optimizes GRPO's clipped-ratio loss
on sampled completions (``grpo.py``): each micro-batch holds whole groups of rows
``prompt + completion`` labelled on the completion, with each row's advantage; the
completion tokens' log-probs under the policy (logits divided by the sampling
temperature) and, with a KL term, under the reference (``lora=None``, under
``stop_gradient``) enter ``grpo.grpo_token_loss``. The KL and clipping sums come back with
the metrics.

Gradients. ``jax.value_and_grad`` is taken w.r.t. the LoRA pytree only; the base weights
are a plain (non-differentiated) argument, so no base-weight gradient is ever built.
Micro-batches are a ``lax.scan`` (one compiled body, accumulation in the LoRA dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.grpo import GRPO_SUM_KEYS, ReinforcementLoss, grpo_token_loss
from trainers.jax_lora.loss import IGNORE_INDEX, LOSS_CHUNK, TokenLosses, token_losses
from trainers.jax_lora.model import LoraRuntime, Params, RematPolicy, hidden_states
from trainers.jax_lora.sharding import ACTIVATION_RULES, logical_to_spec, make_activation_constraint

Batch = dict[str, jax.Array]  # input_ids, labels, positions, segment_ids (GRPO: advantages): (accum, rows, seq)
BATCH_KEYS = ("input_ids", "labels", "positions", "segment_ids")


def make_schedule(
    kind: str, *, base_lr: float, total_steps: int, warmup_steps: int
) -> Callable[[jax.Array], jax.Array]:
    """``trainers.common.schedules.learning_rate_at`` in jnp, as an optax schedule.

    optax calls it with the number of updates done so far, i.e. the 0-based step.
    """
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {kind!r}")

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        warm = base_lr * (step + 1.0) / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)
        if kind == "constant":
            after = jnp.asarray(base_lr, jnp.float32)
        elif kind == "linear":
            after = base_lr * (1.0 - progress)
        else:
            after = base_lr * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, warm, after)

    return schedule


def make_optimizer(
    schedule: Callable[[jax.Array], jax.Array], *, weight_decay: float, max_grad_norm: float | None
) -> optax.GradientTransformation:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8, decoupled decay scaled by lr)."""
    adamw = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


@dataclass(frozen=True)
class StepConfig:
    """Static settings of the compiled step (hashable: part of the jit cache key)."""

    cfg: DecoderConfig
    runtime: LoraRuntime
    remat: RematPolicy = "none"
    compute_dtype: str = "float32"
    packed: bool = True  # False: plain causal rows (no segment mask; fused attention on GPU)
    preference: PreferenceLoss | None = None  # set: the DPO objective instead of token NLL
    reinforcement: ReinforcementLoss | None = None  # set: GRPO's loss on sampled completions
    loss_chunk: int = LOSS_CHUNK  # positions per chunk of the LM head (``loss.py``)


@dataclass(frozen=True)
class PreferenceLoss:
    """DPO's static settings. A micro-batch's rows are ``blocks`` blocks (one per
    data-parallel rank of the loader) of ``2 x pairs`` rows: the chosen answers of the
    block's pairs, then their rejected answers. All-padding pairs (no label) are ignored."""

    beta: float
    sft_weight: float = 0.0
    blocks: int = 1


def _token_losses(sc: StepConfig, params: Params, lora: Params | None, micro: Batch, key: jax.Array | None,
                  constrain, with_accuracy: bool = False) -> TokenLosses:
    """The micro-batch's per-position losses; the logits exist one chunk at a time (``loss.py``);
    a GRPO step's at its sampling temperature."""
    h = hidden_states(
        params, lora, micro["input_ids"], cfg=sc.cfg,
        segment_ids=micro["segment_ids"] if sc.packed else None,
        positions=micro["positions"], runtime=sc.runtime, dropout_key=key, remat=sc.remat,
        compute_dtype=jnp.dtype(sc.compute_dtype), constrain=constrain,
    )
    temperature = sc.reinforcement.temperature if sc.reinforcement is not None else 1.0
    return token_losses(params, h, micro["labels"], cfg=sc.cfg, constrain=constrain, chunk=sc.loss_chunk,
                        with_accuracy=with_accuracy, temperature=temperature)


def make_loss_and_grads(sc: StepConfig, mesh: Mesh | None):
    """``(lora, params, batch, key) -> (loss, grads, n_tokens)`` over all micro-batches.

    ``key`` None disables dropout. The loss is the mean over every trained token of the
    batch; the gradient is that of the same quantity, accumulated micro-batch by
    micro-batch.
    """
    constrain = make_activation_constraint(mesh)
    use_dropout = sc.runtime.dropout > 0.0

    def loss_and_grads(lora: Params, params: Params, batch: Batch, key: jax.Array | None):
        n_tokens = jnp.sum(batch["labels"][:, :, 1:] != IGNORE_INDEX)
        denom = jnp.maximum(n_tokens, 1).astype(jnp.float32)

        def micro_loss(lora: Params, micro: Batch, micro_key: jax.Array | None) -> jax.Array:
            return jnp.sum(_token_losses(sc, params, lora, micro, micro_key, constrain).nll) / denom

        grad_fn = jax.value_and_grad(micro_loss)

        def accumulate(carry, xs):
            loss_sum, grads = carry
            micro, idx = xs
            micro_key = jax.random.fold_in(key, idx) if (use_dropout and key is not None) else None
            loss, g = grad_fn(lora, micro, micro_key)
            return (loss_sum + loss, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, lora)
        n_micro = batch["input_ids"].shape[0]
        (loss, grads), _ = jax.lax.scan(
            accumulate, (jnp.zeros((), jnp.float32), zeros), (batch, jnp.arange(n_micro))
        )
        return loss, grads, n_tokens

    return loss_and_grads


def _accumulate(grad_fn, lora: Params, batch: Batch, key: jax.Array | None, sum_keys: tuple[str, ...]):
    """``(objective, grads, sums)`` summed over the batch's micro-batches (one ``lax.scan``).

    ``grad_fn(lora, micro, micro_key) -> ((objective, sums), grads)``; ``micro_key`` is
    ``fold_in(key, index)``, or None (no dropout) when ``key`` is None.
    """
    def accumulate(carry, xs):
        value_sum, grads, sums = carry
        micro, idx = xs
        micro_key = None if key is None else jax.random.fold_in(key, idx)
        (value, micro_sums), g = grad_fn(lora, micro, micro_key)
        return (value_sum + value, jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, micro_sums)), None

    zero_sums = {k: jnp.zeros((), jnp.float32) for k in sum_keys}
    carry = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, lora), zero_sums)
    n_micro = batch["input_ids"].shape[0]
    (value, grads, sums), _ = jax.lax.scan(accumulate, carry, (batch, jnp.arange(n_micro)))
    return value, grads, sums


def _pairs(x: jax.Array, blocks: int) -> tuple[jax.Array, jax.Array]:
    """Per-row values ``(rows,)`` of a preference micro-batch as (chosen, rejected) ``(pairs,)``."""
    x = x.reshape(blocks, 2, -1)
    return x[:, 0].reshape(-1), x[:, 1].reshape(-1)


def _preference_terms(sc: StepConfig, params: Params, lora: Params, micro: Batch, key: jax.Array | None,
                      constrain) -> dict[str, jax.Array]:
    """Per-pair DPO quantities of one micro-batch: the policy's and (adapter off, no
    gradient) the reference's summed completion log-probs of each answer."""
    pl = sc.preference
    nll, mask, _ = _token_losses(sc, params, lora, micro, key, constrain)
    ref_nll, _, _ = _token_losses(sc, params, None, micro, None, constrain)
    policy_c, policy_r = _pairs(-jnp.sum(nll, axis=-1), pl.blocks)
    ref_c, ref_r = _pairs(jax.lax.stop_gradient(-jnp.sum(ref_nll, axis=-1)), pl.blocks)
    tokens_c, _ = _pairs(jnp.sum(mask, axis=-1), pl.blocks)
    chosen, rejected = policy_c - ref_c, policy_r - ref_r
    valid = tokens_c > 0
    return {
        "valid": valid,
        "loss": jnp.where(valid, -jax.nn.log_sigmoid(pl.beta * (chosen - rejected)), 0.0),
        "chosen": jnp.where(valid, pl.beta * chosen, 0.0),
        "rejected": jnp.where(valid, pl.beta * rejected, 0.0),
        "chosen_nll": -jnp.sum(jnp.where(valid, policy_c, 0.0)),
        "chosen_tokens": jnp.sum(tokens_c),
    }


def _reward_sums(t: dict[str, jax.Array]) -> dict[str, jax.Array]:
    chosen, rejected = jax.lax.stop_gradient(t["chosen"]), jax.lax.stop_gradient(t["rejected"])
    return {
        "pairs": jnp.sum(t["valid"]).astype(jnp.float32),
        "loss_sum": jnp.sum(jax.lax.stop_gradient(t["loss"])),
        "chosen_sum": jnp.sum(chosen),
        "rejected_sum": jnp.sum(rejected),
        "correct": jnp.sum(t["valid"] & (chosen > rejected)).astype(jnp.float32),
        "chosen_nll": jax.lax.stop_gradient(t["chosen_nll"]),
    }


def make_preference_loss_and_grads(sc: StepConfig, mesh: Mesh | None):
    """``(lora, params, batch, key) -> (objective, grads, sums)`` over all micro-batches.

    The objective is the mean DPO sigmoid loss over the batch's pairs plus ``sft_weight``
    x the mean NLL of the chosen answers' tokens, both means over the WHOLE batch, so
    accumulation gives the full batch's gradient (as the token loss above).
    """
    constrain = make_activation_constraint(mesh)
    use_dropout = sc.runtime.dropout > 0.0
    pl = sc.preference

    def loss_and_grads(lora: Params, params: Params, batch: Batch, key: jax.Array | None):
        labelled = jnp.sum(batch["labels"][:, :, 1:] != IGNORE_INDEX, axis=-1)  # (accum, rows)
        per_pair = jax.vmap(lambda x: _pairs(x, pl.blocks))(labelled)
        n_pairs = jnp.maximum(jnp.sum(per_pair[0] > 0), 1).astype(jnp.float32)
        n_chosen = jnp.maximum(jnp.sum(per_pair[0]), 1).astype(jnp.float32)

        def micro_objective(lora: Params, micro: Batch, micro_key: jax.Array | None):
            t = _preference_terms(sc, params, lora, micro, micro_key, constrain)
            value = jnp.sum(t["loss"]) / n_pairs + pl.sft_weight * t["chosen_nll"] / n_chosen
            return value, _reward_sums(t)

        grad_fn = jax.value_and_grad(micro_objective, has_aux=True)
        return _accumulate(grad_fn, lora, batch, key if use_dropout else None, REWARD_SUM_KEYS)

    return loss_and_grads


REWARD_SUM_KEYS = ("pairs", "loss_sum", "chosen_sum", "rejected_sum", "correct", "chosen_nll")


def make_grpo_loss_and_grads(sc: StepConfig, mesh: Mesh | None):
    """``(lora, params, batch, key) -> (loss, grads, sums)`` over all micro-batches.

    Each micro-batch's loss is ``grpo.grpo_token_loss`` divided by the micro-batches of
    the step (``dapo``: over the step's completion tokens), as the torch trainer back-
    propagates each of its micro-batches; ``sums`` are ``grpo.GRPO_SUM_KEYS`` over the step.
    """
    constrain = make_activation_constraint(mesh)
    use_dropout = sc.runtime.dropout > 0.0
    rl = sc.reinforcement

    def loss_and_grads(lora: Params, params: Params, batch: Batch, key: jax.Array | None):
        n_micro = batch["input_ids"].shape[0]
        step_tokens = jnp.sum(batch["labels"][:, :, 1:] != IGNORE_INDEX).astype(jnp.float32)

        def micro_loss(lora: Params, micro: Batch, micro_key: jax.Array | None):
            policy = _token_losses(sc, params, lora, micro, micro_key, constrain)
            reference = None
            if rl.kl_coef > 0:
                reference = -jax.lax.stop_gradient(_token_losses(sc, params, None, micro, None, constrain).nll)
            return grpo_token_loss(
                -policy.nll, None, micro["advantages"][:, 1:], policy.mask, ref_logps=reference,
                kl_coef=rl.kl_coef, epsilon_low=rl.clip_epsilon, loss_type=rl.loss_type,
                max_completion_length=rl.max_completion_tokens, num_items=step_tokens, accumulation=n_micro,
            )

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        return _accumulate(grad_fn, lora, batch, key if use_dropout else None, GRPO_SUM_KEYS)

    return loss_and_grads


def make_preference_eval_step(sc: StepConfig, mesh: Mesh | None):
    """``(lora, params, micro) -> sums`` (:data:`REWARD_SUM_KEYS` + ``chosen_tokens``) of one micro-batch."""
    constrain = make_activation_constraint(mesh)

    def eval_fn(lora: Params, params: Params, micro: Batch) -> dict[str, jax.Array]:
        t = _preference_terms(sc, params, lora, micro, None, constrain)
        return {**_reward_sums(t), "chosen_tokens": t["chosen_tokens"].astype(jnp.float32)}

    return eval_fn


def make_train_step(sc: StepConfig, optimizer: optax.GradientTransformation, mesh: Mesh | None):
    """The pure train step ``(state, params, batch) -> (state, metrics)`` (not yet jitted).

    ``state`` = ``{"lora", "opt_state", "step", "rng"}``; ``rng`` is a fixed key: the
    dropout key of step s is ``fold_in(rng, s)``, so a resumed run draws the same masks.
    """
    preference = sc.preference is not None
    with_sums = preference or sc.reinforcement is not None  # the objective's sums, not a token count
    make = (make_preference_loss_and_grads if preference
            else make_grpo_loss_and_grads if sc.reinforcement is not None else make_loss_and_grads)
    loss_and_grads = make(sc, mesh)

    def step_fn(state: dict[str, Any], params: Params, batch: Batch) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        step_key = jax.random.fold_in(state["rng"], state["step"])
        loss, grads, extra = loss_and_grads(state["lora"], params, batch, step_key)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["lora"])
        lora = optax.apply_updates(state["lora"], updates)
        new_state = {"lora": lora, "opt_state": opt_state, "step": state["step"] + 1, "rng": state["rng"]}
        # token loss: extra = the trained-token count; DPO: the reward sums; GRPO: its sums
        metrics = {"loss": loss, "grad_norm": grad_norm, **(extra if with_sums else {"n_tokens": extra})}
        return new_state, metrics

    return step_fn


def make_eval_step(sc: StepConfig, mesh: Mesh | None):
    """``(lora, params, micro) -> {nll_sum, n_tokens, n_correct}`` for one micro-batch."""
    constrain = make_activation_constraint(mesh)

    def eval_fn(lora: Params, params: Params, micro: Batch) -> dict[str, jax.Array]:
        nll, mask, correct = _token_losses(sc, params, lora, micro, None, constrain, with_accuracy=True)
        return {"nll_sum": jnp.sum(nll), "n_tokens": jnp.sum(mask), "n_correct": jnp.sum(correct)}

    return eval_fn


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """(accum, rows, seq) train batches or (rows, seq) eval batches: rows over data x fsdp."""
    axes = (None, "batch", "seq") if len(shape) == 3 else ("batch", "seq")
    return NamedSharding(mesh, logical_to_spec(axes, mesh, ACTIVATION_RULES, shape))


def state_shardings(
    lora_shardings: Params, optimizer: optax.GradientTransformation, lora_abstract: Params, mesh: Mesh
) -> dict[str, Any]:
    """Shardings of the whole train state: optimizer moments shard like their LoRA factor.

    ``optax.tree_map_params`` walks the optimizer state and maps every leaf that mirrors
    a parameter to that parameter's sharding; counters and other scalars are replicated.
    """
    opt_abstract = jax.eval_shape(optimizer.init, lora_abstract)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _leaf, sharding: sharding,
        opt_abstract,
        lora_shardings,
        transform_non_params=lambda _leaf: replicated(mesh),
    )
    return {"lora": lora_shardings, "opt_state": opt_shardings, "step": replicated(mesh), "rng": replicated(mesh)}


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Put ``x`` on ``sharding`` (multi-host safe: no device_put onto other hosts' devices)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def init_state(
    lora: Params, optimizer: optax.GradientTransformation, shardings: dict[str, Any], rng: jax.Array, step: int = 0
) -> dict[str, Any]:
    """The train state, created directly with its declared shardings.

    ``jax.jit(optimizer.init)`` without ``out_shardings`` would put the moments on one
    device (and force a recompile of the step); we pass the shardings explicitly.
    """
    lora = jax.tree.map(_place, lora, shardings["lora"])
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(lora)
    key_data = _place(np.asarray(jax.random.key_data(rng)), shardings["rng"])
    return {
        "lora": lora,
        "opt_state": opt_state,
        "step": _place(np.asarray(step, np.int32), shardings["step"]),
        "rng": jax.jit(jax.random.wrap_key_data, out_shardings=shardings["rng"])(key_data),
    }


def compile_steps(
    sc: StepConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    shardings: dict[str, Any],
    param_shardings: Params,
):
    """Jit the train step (state donated) and the eval step with their shardings declared."""
    rep = replicated(mesh)

    def batch_shardings(batch: Batch) -> Batch:
        return {k: batch_sharding(mesh, v.shape) for k, v in batch.items()}

    train = make_train_step(sc, optimizer, mesh)
    evaluate = (make_preference_eval_step if sc.preference is not None else make_eval_step)(sc, mesh)
    cache: dict[tuple, Any] = {}

    def jitted_train(batch):
        return jax.jit(
            train,
            in_shardings=(shardings, param_shardings, batch_shardings(batch)),
            out_shardings=(shardings, rep),  # every metric replicated
            donate_argnums=(0,),
        )

    def train_step(state, params, batch):
        key = ("train", tuple(v.shape for v in batch.values()))
        if key not in cache:
            cache[key] = jitted_train(batch)
        return cache[key](state, params, batch)

    def compile_train(state, params, batch):
        """Compile the train step for ``batch``'s shapes now (nothing runs, nothing is
        donated) and keep the executable for the calls that follow: the caller reads XLA's
        ``memory_analysis()`` of what it will run, without compiling twice."""
        key = ("train", tuple(v.shape for v in batch.values()))
        compiled = jitted_train(batch).lower(state, params, batch).compile()
        cache[key] = compiled
        return compiled

    def eval_step(lora, params, micro):
        key = ("eval", tuple(v.shape for v in micro.values()))
        if key not in cache:
            cache[key] = jax.jit(
                evaluate,
                in_shardings=(shardings["lora"], param_shardings, batch_shardings(micro)),
                out_shardings=rep,
            )
        return cache[key](lora, params, micro)

    train_step.cache = cache  # type: ignore[attr-defined]
    train_step.compile = compile_train  # type: ignore[attr-defined]
    return train_step, eval_step
