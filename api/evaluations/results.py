"""What an evaluation's answers and grades add up to (pure): each model's score, the
samples shown side by side, and the job event's one line.

A row the model could not answer (e.g. a prompt over its context) is not graded and
counts 0; so does a row the grader could not grade (a template its item cannot fill, a
python grader that raised). Both are counted in ``errors`` and shown in the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.evaluations.rows import EvaluationRow
from api.evaluations.schemas import DEFAULT_GRADER
from trainers.common.graders import GradeResult

SAMPLES_SHOWN = 5
PROMPT_CHARS = 500  # of a sample's prompt, as shown
# Graders whose rewards are fractions (0..1), shown as percentages.
FRACTION_GRADERS = ("string_check", "text_similarity")


@dataclass(frozen=True)
class Answer:
    """A model's answer to one row: its text, or why there is none."""

    text: str | None
    finish_reason: str | None = None
    error: str | None = None


def grade_error(result: GradeResult) -> str | None:
    """The flags a grade raised (OpenAI's ``metadata.errors``), as one line; None if none."""
    errors = result.errors.as_dict()
    flags = [name for name, value in errors.items() if value is True]
    details = [str(errors[name]) for name in ("python_grader_server_error_type", "python_grader_runtime_error_details",
                                               "model_grader_server_error_details") if errors.get(name)]
    return ", ".join(flags + details)[:500] if flags else None


def model_score(model: str, answers: Sequence[Answer], grades: Sequence[GradeResult | None]) -> dict[str, Any]:
    """``{model, score, count, errors}``: the mean reward over every row (see the module doc)."""
    rewards = [grade.reward if grade is not None else 0.0 for grade in grades]
    errors = sum(1 for answer, grade in zip(answers, grades, strict=True)
                 if answer.text is None or grade is None or grade_error(grade) is not None)
    return {"model": model, "score": sum(rewards) / len(rewards) if rewards else 0.0, "count": len(rewards),
            "errors": errors}


def _shown(answer: Answer, grade: GradeResult | None) -> dict[str, Any]:
    error = answer.error if answer.text is None else (grade_error(grade) if grade is not None else None)
    return {"answer": answer.text, "reward": grade.reward if grade is not None else 0.0, "error": error}


def samples(rows: Sequence[EvaluationRow], answers: dict[str, Sequence[Answer]],
            grades: dict[str, Sequence[GradeResult | None]]) -> list[dict[str, Any]]:
    """The first rows with both models' answers and rewards, side by side."""
    shown = []
    for index, row in enumerate(rows[:SAMPLES_SHOWN]):
        prompt = row.messages[-1]["content"] if row.messages else ""
        shown.append({"line": row.line, "prompt": str(prompt)[:PROMPT_CHARS], "reference": row.reference,
                      **{model: _shown(answers[model][index], grades[model][index]) for model in answers}})
    return shown


def format_score(grader: dict[str, Any], score: float) -> str:
    if grader.get("type") in FRACTION_GRADERS:
        return f"{100 * score:.1f}".removesuffix(".0") + "%"
    return f"{score:.3f}"


def grader_label(grader: dict[str, Any]) -> str:
    """How the event names the grader: "exact match" for the default one."""
    return "exact match" if grader == DEFAULT_GRADER else str(grader.get("name") or grader.get("type"))


def summary(grader: dict[str, Any], results: dict[str, Any], *, from_parent: bool) -> str:
    """The job event of a finished evaluation, e.g. ``Held-out exact match: base 0% ->
    fine-tuned 85% on 20 rows``. The "base" side answers as the job's ``model``: for a job
    that continues a fine-tuned model (``from_parent``) that is the parent, and the event
    says so."""
    start = "parent" if from_parent else "base"
    base, tuned = results["base"], results["fine_tuned"]
    return (f"Held-out {grader_label(grader)}: {start} {format_score(grader, base['score'])} -> fine-tuned "
            f"{format_score(grader, tuned['score'])} on {tuned['count']} rows")
