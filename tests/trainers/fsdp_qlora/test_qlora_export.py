"""QLoRA (single process): training lowers the loss, and the exported adapter, loaded by
``peft`` on the base quantized the same way by the libraries themselves, reproduces the
trainer's logits (fp32 compute)."""

from __future__ import annotations

import pytest
import torch

from trainers.fsdp_qlora.checkpoint import export_adapter
from trainers.fsdp_qlora.distributed import DistContext
from trainers.fsdp_qlora.loading import ModelOptions, build_model
from trainers.fsdp_qlora.train_step import build_optimizer, train_step

from .fsdp_worker import synthetic_batches
from .reference import TARGETS, forward_logits, hf_model

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("quant", ["nf4", "hqq4"])
def test_qlora_trains_and_exported_adapter_reproduces_logits_in_peft(tiny_model_dir, tmp_path, quant):
    from peft import PeftModel

    r = 4
    opts = ModelOptions(model_dir=tiny_model_dir, quantization=quant, lora_r=r, lora_alpha=2.0 * r,
                        target_modules=TARGETS)
    model, _ = build_model(opts, CPU)
    optimizer = build_optimizer(model, learning_rate=2e-2, weight_decay=0.0)
    batches = synthetic_batches(0, 2, 2, 24)  # one fixed batch: the adapter must fit it
    losses = [
        train_step(model, optimizer, batches, CPU, step=s, seed=0, learning_rate=2e-2, max_grad_norm=1.0).loss
        for s in range(8)
    ]
    assert losses[-1] < losses[0] - 0.2, losses

    adapter_dir = export_adapter(tmp_path / "adapter", model, CPU, r=r, alpha=2.0 * r, dropout=0.0,
                                 target_modules=TARGETS)
    probe = synthetic_batches(99, 1, 2, 24)[0]
    with torch.no_grad():
        ours = forward_logits(model, probe)
        peft_model = PeftModel.from_pretrained(hf_model(tiny_model_dir, quant), str(adapter_dir))
        peft_model.train()  # bnb's CPU eval-mode repack would change the kernel, not the math
        theirs = forward_logits(peft_model, probe)
    # The adapter did move the logits (a test that cannot fail is a defect)...
    base = hf_model(tiny_model_dir, quant)
    with torch.no_grad():
        assert (forward_logits(base, probe) - ours).abs().max() > 1e-2
    # ...and peft + the libraries' quantized base reproduce them.
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
