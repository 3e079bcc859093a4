"""What a reinforcement step's grading reports besides its rewards (shared by both trainers):
a multi grader's mean sub-rewards, the completions the grader could not score, and the
job events those raise, once and not per step."""

from __future__ import annotations

import numpy as np
import pytest

from trainers.common.graders import GradingContext, SandboxLimits, parse_grader
from trainers.common.reinforcement import (
    MAX_SUB_REWARD_NAME,
    MAX_SUB_REWARDS,
    GraderErrorWarnings,
    GradingSummary,
    GrpoObjective,
    grade_completions,
    step_metrics,
)

STOP = 0  # token 0 ends an answer; the others are letters: 1 -> "a", 2 -> "b"
ANSWERS = [[1, STOP], [1, 2, STOP], [2], [2, 1, STOP]]  # "a", "ab", "b" (cut at its budget), "ba"
ITEMS = [{"answer": "a"}] * 4


def _objective(grader: dict) -> GrpoObjective:
    return GrpoObjective(
        grader=parse_grader(grader), samples_per_prompt=2, temperature=1.0, kl_coef=0.0, clip_epsilon=0.2,
        loss_type="grpo", max_completion_tokens=4, eval_samples=1, stop_ids=frozenset({STOP}), pad_id=STOP,
        decode=lambda ids: "".join(chr(ord("a") + i - 1) for i in ids if i != STOP),
        grading=GradingContext(sandbox=SandboxLimits(seconds_per_sample=20, startup_seconds=20)),
    )


def _check(name: str, operation: str, reference: str = "{{item.answer}}") -> dict:
    return {"type": "string_check", "name": name, "input": "{{sample.output_text}}", "reference": reference,
            "operation": operation}


MULTI = {"type": "multi", "name": "both", "calculate_output": "0.25 * exact + 0.75 * has_a",
         "graders": {"exact": _check("exact", "eq"), "has_a": _check("has a", "like")}}


def test_a_multi_graders_step_reports_each_sub_graders_mean_reward():
    rewards, grading = grade_completions(_objective(MULTI), ANSWERS, ITEMS)
    # exact ("a" only): 1, 0, 0, 0; has_a ("a", "ab", "ba"): 1, 1, 0, 1
    np.testing.assert_array_equal(rewards, np.array([1.0, 0.75, 0.0, 0.75], dtype=np.float32))
    assert grading == GradingSummary(samples=4, sub_rewards={"exact": 0.25, "has_a": 0.75})
    metrics = step_metrics(rewards, [len(a) for a in ANSWERS], kl_sum=None, clipped_tokens=0.0, grading=grading)
    assert metrics["reward_mean"] == pytest.approx(0.625)
    assert metrics["sub_rewards"] == {"exact": 0.25, "has_a": 0.75}
    assert metrics["grader_errors"] == 0
    assert list(metrics["sub_rewards"]) == ["exact", "has_a"]  # the grader's order


def test_other_graders_report_no_sub_rewards():
    rewards, grading = grade_completions(_objective(_check("has a", "like")), ANSWERS, ITEMS)
    np.testing.assert_array_equal(rewards, np.array([1.0, 1.0, 0.0, 1.0], dtype=np.float32))
    assert grading.sub_rewards is None and grading.errors == 0 and grading.error_kinds == {}
    metrics = step_metrics(rewards, [2, 3, 1, 3], kl_sum=None, clipped_tokens=0.0, grading=grading)
    assert (metrics["sub_rewards"], metrics["grader_errors"]) == (None, 0)
    without = step_metrics(rewards, [2, 3, 1, 3], kl_sum=None, clipped_tokens=0.0)
    assert (without["sub_rewards"], without["grader_errors"]) == (None, None)


def test_completions_the_grader_cannot_score_are_counted_by_kind():
    broken = {**MULTI, "graders": {**MULTI["graders"], "hint": _check("hint", "eq", "{{item.hint}}")}}
    rewards, grading = grade_completions(_objective(broken), ANSWERS, ITEMS)
    # ``hint`` reads what no line has: its reward is 0 and each completion flags the error,
    # while the formula (which does not use it) still scores them.
    np.testing.assert_array_equal(rewards, np.array([1.0, 0.75, 0.0, 0.75], dtype=np.float32))
    assert grading.sub_rewards == {"exact": 0.25, "has_a": 0.75, "hint": 0.0}
    assert grading.errors == 4 and grading.error_kinds == {"invalid_variable_error": 4}
    assert grading.metrics() == {"sub_rewards": {"exact": 0.25, "has_a": 0.75, "hint": 0.0}, "grader_errors": 4}


def test_a_python_grader_that_raises_gives_zero_rewards_and_its_error():
    grader = {"type": "python", "name": "py", "source": (
        "def grade(sample, item):\n"
        "    if sample['output_text'] == 'b':\n"
        "        return 1.0\n"
        "    raise ValueError('no answer key ' + item['answer'])\n")}
    rewards, grading = grade_completions(_objective(grader), ANSWERS, ITEMS)
    np.testing.assert_array_equal(rewards, np.array([0.0, 0.0, 1.0, 0.0], dtype=np.float32))
    assert grading.errors == 3 and grading.error_kinds == {"python_grader_runtime_error": 3}
    assert "ValueError: no answer key a" in grading.error_detail


def test_sub_rewards_are_bounded_to_what_the_api_accepts():
    long_name = "x" * (MAX_SUB_REWARD_NAME + 1)
    names = [long_name] + [f"g{i}" for i in range(MAX_SUB_REWARDS + 2)]
    grader = {"type": "multi", "name": "many", "calculate_output": "g0",
              "graders": {name: _check(name, "like") for name in names}}
    _, grading = grade_completions(_objective(grader), ANSWERS, ITEMS)
    assert list(grading.sub_rewards) == [f"g{i}" for i in range(MAX_SUB_REWARDS)]
    assert set(grading.sub_rewards.values()) == {0.75}


def _failing(errors: int, **kinds: int) -> GradingSummary:
    return GradingSummary(samples=8, errors=errors, error_kinds=kinds, error_detail="ValueError: boom")


def test_grader_errors_warn_at_the_first_step_and_at_a_new_kind_only():
    warnings = GraderErrorWarnings()
    assert warnings.warning(1, GradingSummary(samples=8)) is None
    message, data = warnings.warning(2, _failing(8, python_grader_runtime_error=8))
    assert message.startswith("Step 2: the grader could not score 8 of 8 completions "
                              "(python_grader_runtime_error on 8); they got reward 0. First error: ValueError: boom")
    assert data == {"step": 2, "grader_errors": 8, "samples": 8,
                    "error_kinds": {"python_grader_runtime_error": 8}, "error_detail": "ValueError: boom"}
    assert warnings.warning(3, _failing(8, python_grader_runtime_error=8)) is None
    assert warnings.warning(4, _failing(2, python_grader_runtime_error=2)) is None
    assert warnings.warning(5, GradingSummary(samples=8)) is None
    again, data = warnings.warning(6, _failing(3, python_grader_runtime_error=1, python_grader_server_error=2))
    assert again.startswith("Step 6: the grader could not score 3 of 8 completions")
    assert "python_grader_server_error on 2" in again and "Fix the grader" not in again
    assert warnings.warning(7, _failing(1, python_grader_server_error=1)) is None
