"""``trainers.common.grpo`` equals TRL's GRPO loss: both are fed the same fixed log-probs,
old and reference log-probs, advantages and masks, and TRL's own ``GRPOTrainer._compute_loss``
runs on them (on a stand-in trainer object whose log-prob forward returns the fixed tensors;
every line of the loss is TRL's). Loss, gradient and metrics agree to 1e-6 in fp32."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

from trainers.common.grpo import group_advantages, grpo_loss

B, T, P, G = 6, 7, 3, 3  # 2 prompts x 3 completions, 7 completion tokens, 3 prompt tokens
TOL = 1e-6


class _Accelerator:
    num_processes = 1

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather


def _fixtures(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float32) * 3
    # Old log-probs near the policy's, some far enough that the ratio is clipped either way.
    old = logps + torch.randn(B, T, generator=gen) * 0.3
    ref = logps + torch.randn(B, T, generator=gen) * 0.2
    lengths = torch.tensor([7, 5, 1, 6, 3, 7])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.25, 1.0])
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "rewards": rewards}


def _trl_loss(data, advantages, *, loss_type, beta, eps_low, eps_high, accumulation, max_len):
    logps = data["logps"].clone().requires_grad_(True)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, max_completion_length=max_len,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, accelerator=_Accelerator(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.int64), "prompt_mask": torch.ones(B, P, dtype=torch.int64),
        "completion_ids": torch.ones(B, T, dtype=torch.int64), "completion_mask": data["mask"],
        "advantages": advantages, "old_per_token_logps": data["old"], "ref_per_token_logps": data["ref"],
        # The completion tokens of the whole generation batch (TRL rescales it per accumulation step).
        "num_items_in_batch": data["mask"].sum() * accumulation,
    }
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad, trainer._metrics["train"]


def _advantages_as_trl(rewards: torch.Tensor) -> torch.Tensor:
    # TRL's group scaling ("group"), with its own nan-aware mean and std helpers.
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = trl_utils.nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    return (rewards - mean) / (std + 1e-4)


def test_group_advantages_equal_trls_group_scaling():
    rewards = _fixtures(0)["rewards"]
    ours = group_advantages(rewards, G)
    assert torch.allclose(ours, _advantages_as_trl(rewards), atol=TOL, rtol=0)
    # A group whose samples all scored the same teaches nothing.
    assert torch.equal(group_advantages(torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 0.0]), G)[:3], torch.zeros(3))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(("beta", "eps_low", "eps_high", "accumulation"),
                         [(0.0, 0.2, 0.2, 1), (0.04, 0.2, 0.28, 1), (0.1, 0.1, 0.3, 2)])
def test_loss_gradient_and_metrics_equal_trls(loss_type, beta, eps_low, eps_high, accumulation):
    data = _fixtures(1 + accumulation)
    advantages = group_advantages(data["rewards"], G)
    trl_loss, trl_grad, trl_metrics = _trl_loss(
        data, advantages, loss_type=loss_type, beta=beta, eps_low=eps_low, eps_high=eps_high,
        accumulation=accumulation, max_len=T)

    logps = data["logps"].clone().requires_grad_(True)
    out = grpo_loss(
        logps, data["old"], advantages, data["mask"], ref_per_token_logps=data["ref"], kl_coef=beta,
        epsilon_low=eps_low, epsilon_high=eps_high, loss_type=loss_type, max_completion_length=T,
        # The step's completion tokens: this micro-batch's, once per accumulated micro-batch.
        num_items_in_batch=data["mask"].sum() * accumulation, gradient_accumulation_steps=accumulation,
        rewards=data["rewards"])
    out.loss.backward()

    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - trl_loss.item()) <= TOL, (out.loss.item(), trl_loss.item())
    assert torch.allclose(logps.grad, trl_grad, atol=TOL, rtol=0)
    assert (logps.grad[data["mask"] == 0] == 0).all()  # padding never gets a gradient

    m = out.metrics
    assert m.clip_low == pytest.approx(trl_metrics["clip_ratio/low_mean"][0], abs=TOL)
    assert m.clip_high == pytest.approx(trl_metrics["clip_ratio/high_mean"][0], abs=TOL)
    assert m.clip_fraction == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=TOL)
    assert m.clip_fraction > 0  # the fixtures do clip: the clipping branch is compared, not skipped
    if beta:
        assert m.kl == pytest.approx(trl_metrics["kl"][0], abs=TOL)
    else:
        assert m.kl is None and "kl" not in trl_metrics
    assert m.completion_length == pytest.approx(data["mask"].sum().item() / B)
    assert m.reward_mean == pytest.approx(data["rewards"].mean().item())
    assert m.reward_std == pytest.approx(data["rewards"].std().item())


def test_on_policy_batches_equal_trls_when_no_old_logprobs_are_given():
    data = _fixtures(7)
    advantages = group_advantages(data["rewards"], G)
    on_policy = {**data, "old": None}
    logps = data["logps"].clone().requires_grad_(True)
    trainer_data = dict(on_policy)
    trl_loss, trl_grad, _ = _trl_loss_without_old(trainer_data, advantages)
    out = grpo_loss(logps, None, advantages, data["mask"])
    out.loss.backward()
    assert abs(out.loss.item() - trl_loss.item()) <= TOL
    assert torch.allclose(logps.grad, trl_grad, atol=TOL, rtol=0)
    assert out.metrics.clip_fraction == 0.0


def _trl_loss_without_old(data, advantages):
    logps = data["logps"].clone().requires_grad_(True)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=0.0, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=T, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, accelerator=_Accelerator(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    inputs = {"prompt_ids": torch.ones(B, P, dtype=torch.int64), "prompt_mask": torch.ones(B, P, dtype=torch.int64),
              "completion_ids": torch.ones(B, T, dtype=torch.int64), "completion_mask": data["mask"],
              "advantages": advantages}
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad, trainer._metrics["train"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(torch.ones(5), 2)
    data = _fixtures(0)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(data["logps"], data["old"], torch.zeros(B), data["mask"], kl_coef=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(data["logps"], data["old"], torch.zeros(B), data["mask"], loss_type="dr_grpo")
