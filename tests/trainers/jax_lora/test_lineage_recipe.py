"""The JAX recipe continuing a fine-tuned model, on the 8-device mesh (the parent's frozen
adapter sharded like the trained one): its step-1 loss is the parent's loss on that batch in
transformers + peft, and the exported adapter is one folded LoRA equal to the parent's and
the new adapter applied together by peft."""

from __future__ import annotations

import json

import jax
import pytest
import torch

from tests.trainers.fsdp_qlora.test_recipe_single import FIXED_BATCH
from tests.trainers.jax_lora.specs import make_spec
from tests.trainers.lineage import (
    CHILD,
    PARENT,
    first_step_rows,
    mean_token_loss,
    random_peft_adapter,
    stacked_peft_model,
)
from trainers.jax_lora.recipe import run


def test_a_child_starts_from_its_parent_and_exports_one_folded_adapter(recipe_model, tiny_datasets, tmp_path):
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from trainers.jax_lora.export import export_adapter
    from trainers.jax_lora.recipe import _lora_from_flat

    if jax.device_count() != 8:
        pytest.fail("the mesh test needs the 8 host devices of tests/trainers/jax_lora/conftest.py")
    parent = random_peft_adapter(recipe_model, tmp_path / "parent")
    spec = make_spec(recipe_model, tiny_datasets, tmp_path / "child",
                     model={"parent_adapters": [{"path": str(parent), "name": "ft:tiny:org:ftjob-parent"}]},
                     adapter=CHILD, hyperparameters={"max_steps": 2, "warmup_steps": 0},
                     eval={"every_n_steps": None}, parallelism={"mesh": {"data": 2, "fsdp": 2, "tensor": 2}})
    result = run(spec)
    rows = first_step_rows(spec)
    parent_loss = mean_token_loss(stacked_peft_model(recipe_model, [parent]), rows)
    base_loss = mean_token_loss(AutoModelForCausalLM.from_pretrained(str(recipe_model)).eval(), rows)
    assert result.losses[1] == pytest.approx(parent_loss, abs=1e-4)
    assert abs(parent_loss - base_loss) > 2e-3  # the parent is another model, far outside the tolerance

    adapter = result.output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = PARENT["r"] + CHILD["r"]
    assert (config["r"], config["lora_alpha"]) == (rank, rank)
    assert config["target_modules"] == sorted({*PARENT["targets"], *CHILD["target_modules"]})

    # The new adapter alone (the checkpoint's trained state) applied by peft with the parent.
    state = load_file(str(tmp_path / "child" / "ckpt" / "step-2" / "train_state.safetensors"))
    export_adapter(tmp_path / "own", _lora_from_flat(state), r=CHILD["r"], alpha=CHILD["alpha"], dropout=0.0,
                   target_modules=CHILD["target_modules"])
    with torch.no_grad():
        stacked_logits = stacked_peft_model(recipe_model, [parent, tmp_path / "own"])(FIXED_BATCH).logits
        base = AutoModelForCausalLM.from_pretrained(str(recipe_model)).eval()
        base_logits = base(FIXED_BATCH).logits
        folded_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(FIXED_BATCH).logits
    assert (folded_logits - stacked_logits).abs().max() <= 1e-5
    assert (folded_logits - base_logits).abs().max() > 1e-2
