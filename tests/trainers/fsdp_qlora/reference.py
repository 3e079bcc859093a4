"""Independent references for the FSDP/QLoRA tests: Hugging Face loads + a plain loop.

The reference model is what a user would build with the libraries alone:
``AutoModelForCausalLM.from_pretrained`` (the family's own class; with
``BitsAndBytesConfig`` for NF4, or hqq's own ``AutoHQQHFModel.quantize_model`` for HQQ)
+ ``peft.get_peft_model``. The reference loop
is written out here with plain torch (mean token cross-entropy over the whole batch,
``clip_grad_norm_``, AdamW), not with the trainer's ``train_step``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TARGETS = ("q_proj", "v_proj", "down_proj")


def hf_model(model_dir: Path, quant: str = "none"):
    """The base model as Hugging Face (+ bitsandbytes / hqq) load it, in train mode.

    ``quant``: none, nf4, nf4_dq (NF4 with double quantization) or hqq4.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if quant in ("nf4", "nf4_dq"):
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, device_map="cpu",
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                bnb_4bit_quant_storage=torch.float32, bnb_4bit_use_double_quant=quant == "nf4_dq",
            ),
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if quant == "hqq4":
            from hqq.core.quantize import BaseQuantizeConfig
            from hqq.models.hf.base import AutoHQQHFModel

            AutoHQQHFModel.quantize_model(
                model, quant_config=BaseQuantizeConfig(nbits=4, group_size=64, view_as_float=True),
                compute_dtype=torch.float32, device="cpu",
            )
    # Train mode: on CPUs with avx512_bf16, bitsandbytes repacks an eval-mode Linear4bit's
    # weight in place into a CPU-only layout, which changes the numbers.
    model.train()
    return model


def hf_peft_model(model_dir: Path, quant: str, *, r: int, seed: int = 0):
    """HF model + peft LoRA with the trainer's deterministic initial adapter."""
    from peft import LoraConfig, get_peft_model

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import _init_lora

    model = get_peft_model(
        hf_model(model_dir, quant),
        LoraConfig(r=r, lora_alpha=2.0 * r, lora_dropout=0.0, target_modules=list(TARGETS),
                   task_type="CAUSAL_LM"),
    )
    _init_lora(model, seed, DistContext(0, 1, 0, torch.device("cpu")))
    model.train()
    return model


def forward_logits(model, batch) -> torch.Tensor:
    return model(
        input_ids=torch.as_tensor(batch.input_ids),
        attention_mask=torch.as_tensor(batch.attention_mask),
        position_ids=torch.as_tensor(batch.position_ids),
        use_cache=False,
    ).logits


def reference_train(model, step_batches: list[list], *, lr: float, max_grad_norm: float) -> list[float]:
    """Plain full-batch training; returns the loss of each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)
    losses = []
    for batches in step_batches:
        n_labels = sum(int((np.asarray(b.labels)[:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            logits = forward_logits(model, b)[:, :-1].float()
            labels = torch.as_tensor(b.labels)[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100, reduction="sum")
            (loss / n_labels).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / n_labels)
    return losses


def peft_adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The reference model's LoRA weights under PEFT's saved key names."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def read_adapter(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
