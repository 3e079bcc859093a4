"""The torch recipe running DPO in one process: it learns the preference, reports the
reward metrics, resumes exactly, accumulates exactly, and exports a peft adapter."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainers.dpo_pairs import write_preference_file
from tests.trainers.fsdp_qlora.test_recipe_single import FIXED_BATCH, StopAfterSteps, _run
from trainers.common.checkpointing import list_checkpoints, load_trainer_state
from trainers.common.preference import REWARD_KEYS, VALID_REWARD_KEYS
from trainers.errors import Preempted


@pytest.fixture(scope="module")
def preference_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("preference")
    return write_preference_file(d / "train.jsonl", 8), write_preference_file(d / "valid.jsonl", 4)


@pytest.fixture
def dpo_spec(make_spec, preference_files):
    train, valid = preference_files

    def make(run: str = "dpo", **changes):
        hp = {"batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "learning_rate": 2e-2,
              **changes.pop("hyperparameters", {})}
        return make_spec(run, method={"type": "dpo", "beta": 0.5, **changes.pop("method", {})},
                         data={"train_file": str(train), "validation_file": str(valid), "format": "preference",
                               **changes.pop("data", {})},
                         hyperparameters=hp, **changes)

    return make


def _rows(result):
    return [json.loads(x) for x in (result.output_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_run_learns_the_preference_reports_rewards_and_exports_a_peft_adapter(dpo_spec, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = _run(dpo_spec(hyperparameters={"max_steps": 6, "batch_size": 8, "micro_batch_size": 4}))
    rows = _rows(result)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(set(REWARD_KEYS + VALID_REWARD_KEYS) <= set(r) for r in rows)
    # step 1: adapter B = 0, so the policy is the reference: loss log 2, zero rewards
    assert rows[0]["train_loss"] == pytest.approx(0.693147, abs=1e-5)
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["rewards/accuracy"] == 0.0
    # every step sees all 8 pairs: the loss falls below log 2 as the chosen answers gain
    assert rows[-1]["train_loss"] < 0.65 and rows[-1]["rewards/margin"] > 0.1
    assert rows[-1]["rewards/accuracy"] > 0.5
    assert rows[1]["valid_loss"] is not None and rows[0]["valid_rewards/accuracy"] is None
    assert rows[-1]["valid_loss"] < 0.69 and rows[-1]["valid_rewards/margin"] > 0
    (_, path), = list_checkpoints(result.output_dir.parent / "checkpoints")[-1:]
    saved = load_trainer_state(path).metrics
    assert saved["rewards/margin"] == pytest.approx(rows[-1]["rewards/margin"])
    assert saved["valid_rewards/accuracy"] == rows[-1]["valid_rewards/accuracy"]

    result.model.eval()
    with torch.no_grad():
        trainer_logits = result.model(FIXED_BATCH).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        base_logits = base(FIXED_BATCH).logits
        peft_logits = PeftModel.from_pretrained(base, str(result.output_dir / "adapter")).eval()(FIXED_BATCH).logits
    assert (peft_logits - trainer_logits).abs().max() <= 1e-4
    assert (peft_logits - base_logits).abs().max() > 1e-3


def test_resumed_dpo_run_equals_the_uninterrupted_run(dpo_spec):
    common = {"hyperparameters": {"max_steps": 5}, "checkpoint": {"every_n_steps": 100, "keep_last": 2},
              "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.1}, "eval": {"every_n_steps": None}}
    full = _run(dpo_spec("full", **common))
    with pytest.raises(Preempted):
        _run(dpo_spec("resumed", **common), stop=StopAfterSteps(2))
    resumed = _run(dpo_spec("resumed", **{**common, "checkpoint": {**common["checkpoint"], "resume_from": "latest"}}))
    assert sorted(resumed.losses) == [3, 4, 5]
    for s in (3, 4, 5):
        assert resumed.losses[s] == full.losses[s], s
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a, b), name
    assert [r["step"] for r in _rows(resumed)] == [1, 2, 3, 4, 5]


def test_dpo_gradient_accumulation_equals_the_full_batch(dpo_spec):
    off = {"eval": {"every_n_steps": None}, "data": {"validation_file": None}}
    a = _run(dpo_spec("a", hyperparameters={"micro_batch_size": 1, "max_steps": 3}, method={"sft_weight": 0.3}, **off))
    b = _run(dpo_spec("b", hyperparameters={"micro_batch_size": 4, "max_steps": 3}, method={"sft_weight": 0.3}, **off))
    for s in (1, 2, 3):
        assert a.losses[s] == pytest.approx(b.losses[s], abs=1e-5)
    assert a.losses[3] != pytest.approx(a.losses[1], abs=1e-3)  # it trained
