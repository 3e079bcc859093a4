"""Reinforcement fine-tuning (GRPO) on the JAX trainer: on the 8-device mesh the recipe
samples, grades and trains, reports the reward metrics (the validation reward at the
method's ``eval_interval``), checkpoints and exports a peft adapter; a preempted and
resumed run samples and trains as the uninterrupted one."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.trainers.jax_lora.specs import make_spec, run_stopped_and_resumed
from tests.trainers.jax_lora.test_resume import compilation_cache  # noqa: F401 (fixture)
from trainers.common.checkpointing import list_checkpoints, load_trainer_state
from trainers.common.peft_export import read_peft_adapter
from trainers.common.reinforcement import REINFORCEMENT_KEYS, VALID_REINFORCEMENT_KEYS
from trainers.jax_lora.recipe import run

GRADER = {"type": "string_check", "name": "says a", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}
# GRADER's reward as a multi grader's, so each row reports its one sub-reward too.
MULTI_GRADER = {"type": "multi", "name": "says a", "calculate_output": "says_a", "graders": {"says_a": GRADER}}


def _prompt_file(path, n: int):
    rows = [{"messages": [{"role": "user", "content": f"say a, {i}"}], "answer": "a"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows(out_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def test_grpo_on_a_mesh_reports_rewards_checkpoints_exports_and_resumes_exactly(recipe_model, tmp_path,
                                                                               compilation_cache):  # noqa: F811
    if jax.device_count() != 8:
        pytest.fail("the GRPO recipe test needs the 8 host devices of tests/trainers/jax_lora/conftest.py")
    files = {"chat_train": _prompt_file(tmp_path / "train.jsonl", 8),
             "chat_valid": _prompt_file(tmp_path / "valid.jsonl", 3)}
    overrides = {
        "method": {"type": "reinforcement", "reinforcement": {
            "grader": MULTI_GRADER, "samples_per_prompt": 4, "max_completion_tokens": 6, "kl_coef": 0.05,
            "temperature": 0.9, "eval_interval": 3}},
        "data": {"format": "reinforcement", "max_seq_len": 48},
        # 4 prompts per step, one per data-parallel rank (data 2 x fsdp 2): 16 sampled rows
        "hyperparameters": {"max_steps": 4, "batch_size": 4, "micro_batch_size": 1, "learning_rate": 5e-2,
                            "warmup_steps": 0, "lr_scheduler": "constant"},
        "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.1},
        "parallelism": {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}},
        "eval": {"every_n_steps": None},
    }
    full = make_spec(recipe_model, files, tmp_path / "full", **overrides)
    run(full)
    run_stopped_and_resumed(make_spec(recipe_model, files, tmp_path / "part", **overrides), 2)

    a, b = _rows(tmp_path / "full" / "out"), _rows(tmp_path / "part" / "out")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s, row in a.items():
        assert set(REINFORCEMENT_KEYS + VALID_REINFORCEMENT_KEYS) <= set(row)
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["reward_std"] >= 0.0
        assert row["kl"] >= 0.0 and 0.0 <= row["clip_fraction"] <= 1.0 and 1 <= row["completion_length"] <= 6
        assert row["valid_loss"] is None
        assert row["sub_rewards"] == {"says_a": row["reward_mean"]} and row["grader_errors"] == 0
        assert b[s]["sub_rewards"] == row["sub_rewards"]
        assert (row["valid_reward_mean"] is not None) == (s in (3, 4)), s  # eval_interval 3, and the last step
        for key in ("train_loss", "grad_norm", *REINFORCEMENT_KEYS, "valid_reward_mean"):
            assert b[s][key] == pytest.approx(row[key], abs=1e-6), (s, key)  # resumed = uninterrupted
    assert a[1]["kl"] == 0.0  # the adapter starts as the identity: policy = reference
    assert a[4]["kl"] > 0.0 and a[4]["reward_std"] > 0.0
    checkpoints = list_checkpoints(full.checkpoint.dir)
    assert [step for step, _ in checkpoints] == [2, 4]
    saved = load_trainer_state(checkpoints[-1][1]).metrics
    assert saved["reward_mean"] == a[4]["reward_mean"] and saved["valid_reward_mean"] == a[4]["valid_reward_mean"]

    _, wa = read_peft_adapter(tmp_path / "full" / "out" / "adapter")
    _, wb = read_peft_adapter(tmp_path / "part" / "out" / "adapter")
    assert wa.keys() == wb.keys()
    assert max(float(np.abs(wa[k]).max()) for k in wa if "lora_B" in k) > 0.0  # it trained
    assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) <= 1e-6
