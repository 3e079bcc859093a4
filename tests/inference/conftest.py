"""Inference fixtures: the tiny random Llama and random (non-zero) LoRA adapters for it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Callable[[int], Path]:
    """``make_adapter(seed)``: a PEFT LoRA adapter with random A and B (so it changes the
    output), saved by peft itself."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made: dict[int, Path] = {}

    def make(seed: int) -> Path:
        if seed not in made:
            torch.manual_seed(seed)
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                                   LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                              init_lora_weights=False))
            made[seed] = tmp_path_factory.mktemp(f"adapter-{seed}")
            model.save_pretrained(str(made[seed]))
        return made[seed]

    return make
