"""The torch trainer's DPO objective against TRL's ``DPOTrainer`` on the same batch.

Both sides hold the same tiny base (fp32, NF4 or HQQ) with the same non-zero LoRA
adapter. TRL's reference is its own loss computation (``DPOTrainer._compute_loss``: the
adapter-disabled reference forward, completion-only summed log-probs, the sigmoid loss
and, with ``sft_weight``, its ``sft`` loss term) on a peft model built with the libraries
alone (the base and a new adapter); ours is the trainer's model build and ``preference_backward``. Loss, LoRA
gradients and reward metrics agree to fp32 rounding, also with the trainer's activation
checkpointing (the reference forward runs under no_grad through the checkpointed layers).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainers.dpo_pairs import pair_data
from tests.trainers.fsdp_qlora.reference import TARGETS, hf_model
from trainers.fsdp_qlora.distributed import DistContext
from trainers.fsdp_qlora.loading import ModelOptions, build_model, canonical_name, is_lora_name
from trainers.fsdp_qlora.train_step import PreferenceObjective, preference_backward

CPU = DistContext(0, 1, 0, torch.device("cpu"))
BETA = 0.1


def _set_adapter(model, seed: int = 3) -> None:
    """Overwrite every LoRA factor with seeded noise (B = 0 would make policy = reference)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: canonical_name(kv[0])):
            if is_lora_name(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if is_lora_name(n)}


def _trl_loss_and_grads(base, batch, tokenizer, tmp_path, sft_weight: float):
    """TRL's loss on ``base`` with a new LoRA adapter set to :func:`_set_adapter`'s weights.

    The base and a ``peft_config`` are given to the trainer (a new adapter: TRL's reference
    is then the adapter-disabled base, as ours); a ready peft model would make TRL copy
    its adapter as the reference instead.
    """
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    losses = ["sigmoid", "sft"] if sft_weight else ["sigmoid"]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=losses,
                     loss_weights=[1.0, sft_weight] if sft_weight else None, report_to=[], use_cpu=True)
    lora = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=base, args=args, processing_class=tokenizer, peft_config=lora,
                         train_dataset=Dataset.from_dict({"prompt": ["1+1="], "chosen": ["2"], "rejected": ["3"]}))
    assert "ref" not in trainer.model.peft_config
    # TRL stores a QLoRA adapter in bf16 (the QLoRA paper's choice); the trainer's adapter
    # dtype here is fp32, so compare the same fp32 adapter.
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    _set_adapter(trainer.model)
    inputs = {
        "input_ids": torch.as_tensor(batch.input_ids),
        "attention_mask": torch.as_tensor(batch.attention_mask),
        "completion_mask": torch.as_tensor(batch.labels != -100).long(),
    }
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), _lora_grads(trainer.model), metrics


@pytest.mark.parametrize(("quant", "sft_weight", "checkpointing"), [
    ("none", 0.0, "none"), ("none", 0.5, "non_reentrant"), ("nf4", 0.0, "reentrant"), ("hqq4", 0.0, "none")])
def test_dpo_loss_grads_and_rewards_equal_trl(tiny_model_dir, tiny_tokenizer, tmp_path, quant, sft_weight,
                                              checkpointing):
    batch = next(pair_data(tiny_tokenizer, 3, micro_batch_size=3).micro_batches())

    ours, _ = build_model(ModelOptions(model_dir=tiny_model_dir, quantization=quant, lora_r=4, lora_alpha=8.0,
                                       target_modules=TARGETS, activation_checkpointing=checkpointing), CPU)
    _set_adapter(ours)
    value, sums, _, _ = preference_backward(ours, [batch], CPU, PreferenceObjective(BETA, sft_weight))

    trl_loss, trl_grads, trl_metrics = _trl_loss_and_grads(hf_model(tiny_model_dir, quant), batch, tiny_tokenizer,
                                                           tmp_path, sft_weight)

    assert value == pytest.approx(trl_loss, rel=1e-5, abs=1e-6)
    assert value > 0.01  # the adapter moved the policy off the reference: a real comparison
    grads = _lora_grads(ours)
    assert grads.keys() == trl_grads.keys() and len(grads) == 2 * 2 * len(TARGETS)
    for name, g in grads.items():
        torch.testing.assert_close(g, trl_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    rewards = sums.metrics()
    assert rewards["rewards/chosen"] == pytest.approx(trl_metrics["rewards/chosen"], rel=1e-5, abs=1e-6)
    assert rewards["rewards/rejected"] == pytest.approx(trl_metrics["rewards/rejected"], rel=1e-5, abs=1e-6)
    assert rewards["rewards/accuracy"] == pytest.approx(trl_metrics["rewards/accuracies"], abs=1e-9)
    assert rewards["rewards/margin"] == pytest.approx(trl_metrics["rewards/margins"], rel=1e-5, abs=1e-6)
