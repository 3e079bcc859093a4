"""Exported adapters stand on their own: public base id, tokenizer, model card, and
``AutoPeftModelForCausalLM`` loading wherever that id resolves (final output and checkpoints).

The recipe runs for real (fsdp_qlora, one process, 2 steps); the base model id is made
resolvable the way a local Hub mirror would: a directory of that name under the working
directory, which ``from_pretrained`` tries before any download.
"""

from __future__ import annotations

import json

import torch

from tests.trainers.fsdp_qlora.test_recipe_single import FIXED_BATCH, _run

PUBLIC_ID = "acme/tiny-chat"


def _front_matter(card: str) -> dict[str, str]:
    head = card.split("---\n")[1]
    return dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)


def test_final_and_checkpoint_adapters_load_by_public_id(make_spec, tiny_model_dir, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = make_spec(model={"path": str(tiny_model_dir), "name": PUBLIC_ID},
                     hyperparameters={"max_steps": 2}, checkpoint={"every_n_steps": 1})
    result = _run(spec)
    final = result.output_dir / "adapter"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1" / "adapter"

    for adapter in (final, checkpoint):
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == PUBLIC_ID
        card = (adapter / "README.md").read_text()
        meta = _front_matter(card)
        assert meta["library_name"] == "peft" and json.loads(meta["base_model"]) == PUBLIC_ID
        training = json.loads(card.split("```json\n")[1].split("```")[0])
        assert training["adapter"]["r"] == 4 and training["hyperparameters"]["max_steps"] == 2
        assert (adapter / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    manifest = {f["name"] for f in json.loads((result.output_dir / "manifest.json").read_text())["files"]}
    assert {"adapter/README.md", "adapter/tokenizer.json", "adapter/tokenizer_config.json"} <= manifest

    (tmp_path / "acme").mkdir()
    (tmp_path / PUBLIC_ID).symlink_to(tiny_model_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))(FIXED_BATCH).logits
        for adapter in (final, checkpoint):
            by_id = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()(FIXED_BATCH).logits
            base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
            explicit = PeftModel.from_pretrained(base, str(adapter)).eval()(FIXED_BATCH).logits
            torch.testing.assert_close(by_id, explicit, rtol=0, atol=0)
            assert (by_id - base_logits).abs().max() > 1e-4  # the adapter is applied, not ignored
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    reference = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(messages)
