"""The torch recipe continuing a fine-tuned model: it starts from exactly the parent's model
(its step-1 loss is the parent's loss on that batch, on a plain or an NF4 base), DPO's
reference is the parent, and the exported adapter is one folded LoRA equal to the parent's
and the new adapter applied together by peft."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainers.dpo_pairs import write_preference_file
from tests.trainers.fsdp_qlora.reference import hf_model
from tests.trainers.fsdp_qlora.test_recipe_single import FIXED_BATCH, _run
from tests.trainers.lineage import (
    CHILD,
    PARENT,
    first_step_rows,
    mean_token_loss,
    random_peft_adapter,
    stacked_peft_model,
)


@pytest.fixture(scope="module")
def parent_adapter(tiny_model_dir, tmp_path_factory):
    return random_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("parent") / "adapter")


def _parents(parent_adapter):
    return {"parent_adapters": [{"path": str(parent_adapter), "name": "ft:tunefleet-tiny-llama:org:ftjob-parent"}]}


def test_a_child_starts_from_its_parent_and_exports_one_folded_adapter(make_spec, tiny_model_dir, parent_adapter,
                                                                        tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = make_spec("child", model=_parents(parent_adapter), adapter=CHILD,
                     hyperparameters={"max_steps": 2}, eval={"every_n_steps": None})
    result = _run(spec)
    rows = first_step_rows(spec)
    parent_loss = mean_token_loss(stacked_peft_model(tiny_model_dir, [parent_adapter]), rows)
    base_loss = mean_token_loss(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval(), rows)
    assert result.losses[1] == pytest.approx(parent_loss, abs=1e-5)
    assert abs(parent_loss - base_loss) > 1e-2  # the parent really is another model

    adapter = result.output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = PARENT["r"] + CHILD["r"]
    assert (config["r"], config["lora_alpha"]) == (rank, rank)
    assert config["target_modules"] == sorted({*PARENT["targets"], *CHILD["target_modules"]})
    assert "Continues the fine-tuned model `ft:tunefleet-tiny-llama:org:ftjob-parent`" in (
        adapter / "README.md").read_text()
    checkpoint = Path(spec.checkpoint.dir) / "step-2" / "adapter" / "adapter_config.json"
    assert json.loads(checkpoint.read_text())["r"] == rank  # checkpoints serve the whole chain too

    # The new adapter alone, as peft saves it from the trainer's model, applied with the parent.
    result.model.save_pretrained(str(tmp_path / "own"), selected_adapters=["default"])
    result.model.eval()
    with torch.no_grad():
        trainer_logits = result.model(FIXED_BATCH).logits
        stacked_logits = stacked_peft_model(tiny_model_dir, [parent_adapter, tmp_path / "own"])(FIXED_BATCH).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
        folded_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(FIXED_BATCH).logits
    assert (folded_logits - stacked_logits).abs().max() <= 1e-5
    assert (folded_logits - trainer_logits).abs().max() <= 1e-4


def test_a_child_on_a_4bit_base_starts_from_the_parent_on_that_base(make_spec, tiny_model_dir, parent_adapter):
    spec = make_spec("qlora-child", model=_parents(parent_adapter),
                     adapter={**CHILD, "method": "qlora", "quantization": "nf4"},
                     hyperparameters={"max_steps": 1}, eval={"every_n_steps": None})
    result = _run(spec)
    reference = stacked_peft_model(tiny_model_dir, [parent_adapter], base=hf_model(tiny_model_dir, "nf4"))
    reference.train()  # an eval-mode bitsandbytes layer may repack its weight (reference.hf_model)
    assert result.losses[1] == pytest.approx(mean_token_loss(reference, first_step_rows(spec)), abs=1e-5)


def test_a_dpo_child_measures_its_rewards_against_the_parent(make_spec, parent_adapter, tmp_path):
    train = write_preference_file(tmp_path / "train.jsonl", 8)
    spec = make_spec("dpo-child", model=_parents(parent_adapter), adapter=CHILD,
                     method={"type": "dpo", "beta": 0.5},
                     data={"train_file": str(train), "validation_file": None, "format": "preference"},
                     hyperparameters={"max_steps": 2}, eval={"every_n_steps": None})
    result = _run(spec)
    rows = [json.loads(x) for x in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 1: the policy is the parent (B = 0) and so is the reference, to the bit; against
    # the base model the parent's rewards would be far from 0.
    assert rows[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["rewards/rejected"] == 0.0
    assert rows[1]["rewards/margin"] != 0.0
