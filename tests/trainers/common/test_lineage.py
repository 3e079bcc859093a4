"""Folding a chain of LoRA adapters into one (``trainers.common.lineage``), checked against
peft applying the same adapters together, and the checks on a parent adapter."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainers.lineage import random_peft_adapter, stacked_peft_model
from trainers.common.lineage import fold, read_adapter, read_parent_adapters
from trainers.common.peft_export import write_peft_adapter
from trainers.errors import UserError

TOKENS = torch.tensor([[256, 259, 117, 115, 101, 114, 260, 10, 97, 102, 116, 101, 114, 63, 261, 259, 97]])


def test_a_folded_chain_is_exactly_its_adapters_applied_together_by_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    chain = [random_peft_adapter(tiny_model_dir, tmp_path / "a"),
             random_peft_adapter(tiny_model_dir, tmp_path / "b", r=2, alpha=8.0,
                                 targets=("q_proj", "k_proj", "down_proj"), seed=1),
             random_peft_adapter(tiny_model_dir, tmp_path / "c", r=4, alpha=4.0, targets=("o_proj",), seed=2)]
    parts = [read_adapter(d)[0] for d in chain]
    # A grandchild: the parent's export is already the fold of its own parent and itself.
    folded = fold([fold(parts[:2]), parts[2]])
    assert (folded.r, folded.scaling) == (9, 1.0)
    assert folded.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    write_peft_adapter(tmp_path / "folded", folded.weights, r=folded.r, alpha=folded.r, dropout=0.0,
                       target_modules=folded.target_modules)

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        loaded = PeftModel.from_pretrained(base, str(tmp_path / "folded")).eval()
        folded_logits = loaded(TOKENS).logits
        loaded.unload()
        stacked_logits = stacked_peft_model(tiny_model_dir, chain, base=base)(TOKENS).logits
    assert (folded_logits - stacked_logits).abs().max() <= 1e-5
    assert (stacked_logits - base_logits).abs().max() > 0.1  # the adapters do change the model


def test_a_parent_adapter_must_be_a_plain_lora_of_the_jobs_base(tiny_model_dir, tmp_path, make_spec):
    parent = random_peft_adapter(tiny_model_dir, tmp_path / "parent")
    spec = make_spec(model={"parent_adapters": [{"path": str(parent), "name": "ft:tiny:org:ftjob-1"}]})
    assert read_parent_adapters(spec).r == 3
    assert read_parent_adapters(make_spec()) is None

    config_path = parent / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "someone/another-model"}))
    with pytest.raises(UserError) as err:
        read_parent_adapters(spec)
    assert err.value.code == "parent_adapter_mismatch" and "ft:tiny:org:ftjob-1" in err.value.message
    config_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UserError) as err:
        read_parent_adapters(spec)
    assert err.value.code == "invalid_parent_adapter"
    with pytest.raises(UserError) as err:
        read_parent_adapters(make_spec(model={"parent_adapters": [{"path": str(tmp_path / "none")}]}))
    assert err.value.code == "parent_adapter_not_found"
