"""Reinforcement fine-tuning (GRPO) on the torch trainer, one process: the real entry point
trains, reports the reward metrics, checkpoints and exports a peft adapter; a resumed run
equals the uninterrupted one; one step's loss and LoRA gradient are ``trainers.common.grpo``'s
on the same completions; multi-rank jobs are refused clearly (the JAX trainer runs reinforcement
on a mesh: ``tests/trainers/jax_lora/test_grpo_recipe.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainers.fsdp_qlora.test_recipe_single import FIXED_BATCH, StopAfterSteps, _run
from tests.trainers.golden.job import run_entry_point
from trainers.common.checkpointing import list_checkpoints, load_trainer_state
from trainers.common.reinforcement import GRADING_KEYS, REINFORCEMENT_KEYS, VALID_REINFORCEMENT_KEYS
from trainers.errors import Preempted, UserError

GRADER = {"type": "string_check", "name": "says a", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}
# GRADER's reward, with a sub-grader beside it that reads a key no line has: it cannot score
# any completion (reward 0, invalid_variable_error) and the formula ignores it.
MULTI_GRADER = {"type": "multi", "name": "says a", "calculate_output": "says_a", "graders": {
    "says_a": GRADER, "hint": {**GRADER, "name": "hint", "reference": "{{item.hint}}"}}}


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")

    def write(name: str, n: int):
        rows = [{"messages": [{"role": "user", "content": f"say a, {i}"}], "answer": "a"} for i in range(n)]
        path = d / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path

    return write("train.jsonl", 8), write("valid.jsonl", 4)


@pytest.fixture
def rft_spec(make_spec, prompt_files):
    train, valid = prompt_files

    def make(run: str = "rft", **changes):
        hp = {"batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "learning_rate": 5e-2,
              "lr_scheduler": "constant", **changes.pop("hyperparameters", {})}
        method = {"grader": GRADER, "samples_per_prompt": 4, "max_completion_tokens": 6, "kl_coef": 0.05,
                  **changes.pop("reinforcement", {})}
        return make_spec(run, method={"type": "reinforcement", "reinforcement": method},
                         data={"train_file": str(train), "validation_file": str(valid), "format": "reinforcement",
                               **changes.pop("data", {})},
                         hyperparameters=hp, **changes)

    return make


def _rows(output_dir):
    return [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_entry_point_trains_reports_rewards_checkpoints_and_exports_a_peft_adapter(rft_spec, tiny_model_dir,
                                                                                     tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = rft_spec(eval={"every_n_steps": 2, "max_batches": 1}, reinforcement={"grader": MULTI_GRADER})
    run = run_entry_point(spec, tmp_path / "entry")
    assert run.returncode == 0, run.output[-3000:]
    rows = run.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(REINFORCEMENT_KEYS + GRADING_KEYS + VALID_REINFORCEMENT_KEYS) <= set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_std"] >= 0.0
        assert r["kl"] >= 0.0 and 0.0 <= r["clip_fraction"] <= 1.0 and 1 <= r["completion_length"] <= 6
        assert r["valid_loss"] is None
        # the reward is the says_a sub-grader's; hint scores nothing, on each of the 4 x 4 completions
        assert r["sub_rewards"] == {"says_a": r["reward_mean"], "hint": 0.0}
        assert r["grader_errors"] == 16
    assert rows[0]["kl"] == 0.0  # the adapter starts as the identity: policy = reference
    assert [r["valid_reward_mean"] is not None for r in rows] == [False, True, False, True]
    reported = [i for i in run.reports if i.get("type") == "metric"]
    assert [i["reward_mean"] for i in reported] == [r["reward_mean"] for r in rows]
    assert [(i["sub_rewards"], i["grader_errors"]) for i in reported] == [
        (r["sub_rewards"], r["grader_errors"]) for r in rows]
    # the same failure on every step: one warning, at the first step
    warnings = [i for i in run.reports if i.get("type") == "event" and i["level"] == "warn"]
    assert [(w["data"]["step"], w["data"]["error_kinds"]) for w in warnings] == [
        (1, {"invalid_variable_error": 16})]
    assert "could not score 16 of 16 completions" in warnings[0]["message"]
    steps = [step for step, _ in list_checkpoints(spec.checkpoint.dir)]
    assert steps == [2, 4]
    saved = load_trainer_state(list_checkpoints(spec.checkpoint.dir)[-1][1]).metrics
    assert saved["reward_mean"] == rows[-1]["reward_mean"]
    assert saved["valid_reward_mean"] == rows[-1]["valid_reward_mean"]
    assert "sub_rewards" not in saved

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        base_logits = base(FIXED_BATCH).logits
        tuned = PeftModel.from_pretrained(base, f"{spec.output_dir}/adapter").eval()
        assert (tuned(FIXED_BATCH).logits - base_logits).abs().max() > 1e-4  # it trained


def test_resumed_run_samples_and_trains_as_the_uninterrupted_run(rft_spec):
    common = {"hyperparameters": {"max_steps": 4}, "checkpoint": {"every_n_steps": 100, "keep_last": 2},
              "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.1}, "eval": {"every_n_steps": None},
              "data": {"validation_file": None}}
    full = _run(rft_spec("full", **common))
    with pytest.raises(Preempted):
        _run(rft_spec("resumed", **common), stop=StopAfterSteps(2))
    resumed = _run(rft_spec("resumed", **{**common, "checkpoint": {**common["checkpoint"], "resume_from": "latest"}}))
    assert sorted(resumed.losses) == [3, 4]
    a, b = _rows(full.output_dir), _rows(resumed.output_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        for key in ("train_loss", "grad_norm", *REINFORCEMENT_KEYS):
            assert y[key] == pytest.approx(x[key], abs=1e-5), (x["step"], key)
    for (name, p), (_, q) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p, q, atol=1e-6), name


def test_one_step_equals_grpo_loss_on_the_same_completions(rft_spec):
    """The recipe's backward (two micro-batches, its own log-prob path, the reference with
    the LoRA layers switched off) against a plain forward + ``grpo_loss`` on the whole batch,
    the reference through peft's own ``disable_adapter()``."""
    from trainers.common.grpo import group_advantages, grpo_loss
    from trainers.common.reporter import Reporter
    from trainers.common.signals import StopFlag
    from trainers.fsdp_qlora.grpo_step import completion_rows, grpo_backward, sample_and_grade, sampling_generator
    from trainers.fsdp_qlora.recipe import FsdpQloraRecipe

    spec = rft_spec("grad", reinforcement={"kl_coef": 0.1, "max_completion_tokens": 5})
    recipe = FsdpQloraRecipe()
    reporter = Reporter(url=None, local_path=f"{spec.checkpoint.dir}/reports.jsonl")
    try:
        recipe.setup(spec, reporter, StopFlag())
        model, ctx, objective = recipe.model, recipe.ctx, recipe.grpo
        torch.manual_seed(1)
        with torch.no_grad():  # a non-zero B, so the adapter changes the policy
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
        prompts, _ = recipe.data.train.take(recipe.progress.cursor, 4)
        sampled = sample_and_grade(model, prompts, objective, ctx, sampling_generator(0, 0, ctx.device), 4)
        sampled.rewards = torch.tensor([1.0, 0.0, 0.5, 0.0] * 4) * torch.arange(1, 17) / 16  # varied in each group
        loss, metrics, _, _ = grpo_backward(model, sampled, objective, ctx, micro_batch_size=2)
        lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
        recipe_grads = {n: p.grad.detach().clone() for n, p in lora.items()}
        model.zero_grad(set_to_none=True)

        rows = completion_rows([p.input_ids for p in sampled.prompts], sampled.completions, objective.pad_id,
                               ctx.device)
        starts = [len(p.input_ids) for p in sampled.prompts]
        width = rows.completion_mask.shape[1]

        def token_logps(logits):
            logps = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
            targets = rows.input_ids[:, 1:]
            per_position = logps.gather(-1, targets[..., None]).squeeze(-1)
            out = torch.zeros(rows.completion_mask.shape)
            for r, s in enumerate(starts):
                n = int(rows.completion_mask[r].sum())
                out[r, :n] = per_position[r, s - 1 : s - 1 + n]
            return out[:, :width]

        inputs = {"input_ids": rows.input_ids, "attention_mask": rows.attention_mask}
        with torch.no_grad(), model.disable_adapter():
            reference = token_logps(model(**inputs).logits)
        for p in lora.values():  # peft's disable_adapter() also toggles requires_grad
            p.requires_grad_(True)
        policy = token_logps(model(**inputs).logits)
        direct = grpo_loss(policy, None, group_advantages(sampled.rewards, 4), rows.completion_mask,
                           ref_per_token_logps=reference, kl_coef=0.1, epsilon_low=0.2, rewards=sampled.rewards)
        direct.loss.backward()
    finally:
        recipe.cleanup()
        reporter.close()
    assert loss == pytest.approx(direct.metrics.loss, abs=1e-6)
    assert metrics["kl"] == pytest.approx(direct.metrics.kl, abs=1e-6)
    assert metrics["reward_mean"] == pytest.approx(direct.metrics.reward_mean, abs=1e-6)
    assert metrics["completion_length"] == pytest.approx(direct.metrics.completion_length, abs=1e-6)
    assert max(float(g.abs().max()) for g in recipe_grads.values()) > 1e-4
    for name, p in lora.items():
        torch.testing.assert_close(recipe_grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_multi_rank_jobs_refuse_reinforcement(rft_spec, tmp_path):
    from trainers.common.reporter import Reporter
    from trainers.common.signals import StopFlag
    from trainers.fsdp_qlora.launch import FsdpQloraLauncher

    reporter = Reporter(url=None, local_path=tmp_path / "reports.jsonl")
    try:
        with pytest.raises(UserError) as refused:
            FsdpQloraLauncher().setup(rft_spec("ranks", parallelism={"world_size": 2}), reporter, StopFlag())
        assert refused.value.code == "reinforcement_multi_rank"
    finally:
        reporter.close()
