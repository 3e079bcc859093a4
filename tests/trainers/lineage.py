"""References for the tests of jobs that continue a fine-tuned model (``trainers.common.lineage``).

Every reference is what a user would build with transformers + peft alone: a parent adapter
with random A and B (peft's ``init_lora_weights=False``, so its delta is far from zero), the
base with several adapters active at once (peft's multi-adapter API), and a step's mean
token cross-entropy on a plain forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# A parent and a child adapter that adapt different modules, with different ranks and scales.
PARENT = {"r": 3, "alpha": 5.0, "targets": ("q_proj", "v_proj", "up_proj")}
CHILD = {"r": 2, "alpha": 6.0, "target_modules": ["q_proj", "k_proj", "o_proj", "down_proj"]}


def random_peft_adapter(base_dir: Path, out_dir: Path, *, r: int = PARENT["r"], alpha: float = PARENT["alpha"],
                        targets: Sequence[str] = PARENT["targets"], seed: int = 0) -> Path:
    """A peft LoRA adapter of ``base_dir`` with random A and B, saved by peft to ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                            init_lora_weights=False))
    with torch.no_grad():  # peft's random B is as large as A: keep the delta comparable to the weights
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.mul_(0.2)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def stacked_peft_model(base_dir: Path, adapter_dirs: Sequence[Path], base=None):
    """``base`` (default: ``base_dir`` in float32) with every adapter of ``adapter_dirs``
    loaded by peft and all of them active together, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    names = [f"adapter{i}" for i in range(len(adapter_dirs))]
    model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name=names[0])
    for name, adapter_dir in zip(names[1:], adapter_dirs[1:], strict=True):
        model.load_adapter(str(adapter_dir), adapter_name=name)
    model.base_model.set_adapter(names)
    return model.eval()


def first_step_rows(spec) -> list:
    """The micro-batches of the first optimizer step of ``spec``'s job (the trainers' own data
    order, one data-parallel rank)."""
    from trainers.common.job_data import load_tokenizer
    from trainers.common.preference import load_training_data

    data = load_training_data(spec, load_tokenizer(spec.model.path))
    batches = data.train.micro_batches()
    return [next(batches) for _ in range(spec.hyperparameters.batch_size // spec.hyperparameters.micro_batch_size)]


def mean_token_loss(model, batches: Sequence) -> float:
    """Mean next-token cross-entropy over every label token of ``batches`` (a step's loss)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=torch.as_tensor(b.input_ids), attention_mask=torch.as_tensor(b.attention_mask),
                           position_ids=torch.as_tensor(b.position_ids)).logits[:, :-1].double()
            labels = torch.as_tensor(b.labels)[:, 1:]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=-100, reduction="sum"))
            count += int((np.asarray(b.labels)[:, 1:] != -100).sum())
    return total / count
