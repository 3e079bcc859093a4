"""The JAX trainer's GRPO loss = the torch trainer's on the same samples and advantages.

The torch trainer's ``trainers.common.grpo.grpo_loss`` is itself checked against TRL's
``GRPOTrainer._compute_loss`` (``tests/trainers/test_grpo_trl_parity.py``) and its step
against a plain forward (``tests/trainers/fsdp_qlora/test_grpo_recipe.py``). Here
``grpo.grpo_token_loss`` equals ``grpo_loss`` (loss, gradient, KL and clipping) for every
averaging on fixed log-probs, and a JAX step's loss, sums and LoRA gradients equal the
torch trainer's ``grpo_backward`` on the same completions, rewards and adapter (two
micro-batches, a sampling temperature, a KL term to the adapter-off reference), to fp32
rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.trainers.jax_lora.batches import lora_grads, random_lora, torch_model_with_lora
from trainers.common.reinforcement import GrpoObjective, Prompt, group_advantages, step_metrics
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import to_peft_weights
from trainers.jax_lora.grpo import ReinforcementLoss, Sampled, grpo_batch, grpo_token_loss
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_runtime, lora_shapes
from trainers.jax_lora.sharding import make_mesh
from trainers.jax_lora.step import StepConfig, make_grpo_loss_and_grads

TARGETS = ("q_proj", "v_proj", "down_proj")
R, ALPHA, G = 4, 8.0, 4
TEMPERATURE, KL, CLIP, MAX_NEW = 0.7, 0.1, 0.2, 7
PAD = 258


def _fixed_logps(seed: int = 0) -> dict[str, np.ndarray]:
    """6 completions of up to 7 tokens: log-probs, old ones off by enough to clip both ways."""
    rng = np.random.default_rng(seed)
    logps = -rng.random((6, 7), dtype=np.float32) * 3
    lengths = np.array([7, 5, 1, 6, 3, 7])
    return {"logps": logps, "old": logps + rng.standard_normal((6, 7)).astype(np.float32) * 0.3,
            "ref": logps + rng.standard_normal((6, 7)).astype(np.float32) * 0.2,
            "mask": (np.arange(7)[None, :] < lengths[:, None]).astype(np.float32),
            "advantages": np.array([1.2, -0.4, 0.0, -1.1, 0.3, 0.9], np.float32)}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_token_loss_equals_the_torch_loss(loss_type):
    from trainers.common.grpo import grpo_loss

    d = _fixed_logps()
    options = {"kl_coef": 0.05, "epsilon_low": 0.2, "epsilon_high": 0.28, "loss_type": loss_type}
    accumulation, num_items = 2, float(d["mask"].sum() * 2)

    def ours(logps):
        return grpo_token_loss(logps, jnp.asarray(d["old"]), jnp.asarray(d["advantages"]), jnp.asarray(d["mask"]),
                               ref_logps=jnp.asarray(d["ref"]), max_completion_length=9, num_items=num_items,
                               accumulation=accumulation, **options)

    (loss, sums), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(d["logps"]))
    logps = torch.tensor(d["logps"], requires_grad=True)
    reference = grpo_loss(logps, torch.tensor(d["old"]), torch.tensor(d["advantages"]), torch.tensor(d["mask"]),
                          ref_per_token_logps=torch.tensor(d["ref"]), max_completion_length=9,
                          num_items_in_batch=num_items, gradient_accumulation_steps=accumulation, **options)
    reference.loss.backward()
    tokens = float(d["mask"].sum())
    assert float(loss) == pytest.approx(float(reference.loss.detach()), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), logps.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert float(sums["completion_tokens"]) == tokens
    assert float(sums["kl_sum"]) / tokens == pytest.approx(reference.metrics.kl, rel=1e-6)
    assert float(sums["clipped"]) / tokens == pytest.approx(reference.metrics.clip_fraction, abs=1e-7)
    assert 0 < reference.metrics.clip_low and 0 < reference.metrics.clip_high  # both clips happen


def _samples() -> tuple[list[Prompt], list[list[int]], np.ndarray]:
    """4 prompts (3 to 9 tokens) x 4 completions (1 to 7 tokens), rewards varied in each group."""
    rng = np.random.default_rng(1)
    prompts = [Prompt(tuple(int(x) for x in rng.integers(0, 256, n)), {}, MAX_NEW) for n in (5, 9, 3, 7)]
    flat = [p for p in prompts for _ in range(G)]
    completions = [[int(x) for x in rng.integers(0, 256, rng.integers(1, MAX_NEW + 1))] for _ in flat]
    rewards = (np.array([1.0, 0.0, 0.5, 0.25] * 4, np.float32) * np.arange(1, 17) / 16).astype(np.float32)
    return flat, completions, rewards


def _jax_step(model_dir, lora, loss_type):
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32)
    flat, completions, rewards = _samples()
    batch = grpo_batch(Sampled(flat, completions, rewards), group_advantages(rewards, G), accumulation=2,
                       row_len=16, pad_id=PAD)
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), packed=False,
                    reinforcement=ReinforcementLoss(kl_coef=KL, clip_epsilon=CLIP, loss_type=loss_type,
                                                    temperature=TEMPERATURE, max_completion_tokens=MAX_NEW))
    loss, grads, sums = jax.jit(make_grpo_loss_and_grads(sc, None))(lora, params, batch, None)
    return float(loss), jax.tree.map(np.asarray, grads), {k: float(v) for k, v in sums.items()}


def _torch_step(model_dir, peft_lora, loss_type):
    from trainers.fsdp_qlora.grpo_step import _Sampled, grpo_backward

    model, cpu = torch_model_with_lora(model_dir, "none", peft_lora, r=R, alpha=ALPHA, targets=TARGETS)
    flat, completions, rewards = _samples()
    objective = GrpoObjective(grader=None, samples_per_prompt=G, temperature=TEMPERATURE, kl_coef=KL,
                              clip_epsilon=CLIP, loss_type=loss_type, max_completion_tokens=MAX_NEW, eval_samples=1,
                              stop_ids=frozenset(), pad_id=PAD, decode=str)
    loss, metrics, _, _ = grpo_backward(model, _Sampled(flat, completions, torch.from_numpy(rewards)), objective, cpu,
                                        micro_batch_size=2)
    grads = lora_grads(model)
    return loss, metrics, grads


# dapo: its normalizer is the whole step's completion tokens, across the micro-batches
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_jax_grpo_step_equals_the_torch_trainers(tiny_untied, loss_type):
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=5, scale=0.2)

    loss, grads, sums = _jax_step(tiny_untied, lora, loss_type)
    t_loss, t_metrics, t_grads = _torch_step(tiny_untied, to_peft_weights(lora), loss_type)

    assert loss == pytest.approx(t_loss, rel=1e-5, abs=1e-6)
    _, completions, rewards = _samples()
    metrics = step_metrics(rewards, [len(c) for c in completions], kl_sum=sums["kl_sum"],
                           clipped_tokens=sums["clipped"])
    assert metrics["kl"] > 1e-3  # the adapter moved the policy off the reference
    for key in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length"):
        assert metrics[key] == pytest.approx(t_metrics[key], rel=1e-5, abs=1e-7), key
    ours = to_peft_weights(grads)
    assert ours.keys() == t_grads.keys()
    assert max(float(np.abs(g).max()) for g in ours.values()) > 1e-3
    for k in ours:
        np.testing.assert_allclose(ours[k], t_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
