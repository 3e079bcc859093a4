"""Grading: a grader, the model's samples and their data rows in; rewards out.

:func:`grade_batch` is what a training loop calls once per batch: ``grade_batch(grader,
samples, items, context)`` -> one :class:`GradeResult` per sample (``reward`` in the
grader's terms, OpenAI's error flags, sub-rewards of a ``multi``). A sample never raises:
whatever goes wrong on it (a template naming what its row lacks, a model grader that does
not answer, a python grader that raises or is stopped by the sandbox) gives reward 0 and
the matching flag, as OpenAI's ``graders/run`` reports it. A python grader grades the
whole batch in one sandboxed process (``sandbox.grade_in_sandbox``): one job's samples,
one grader, never another tenant's.

:class:`GradingContext` carries what grading needs from the caller: the chat-completion
call for ``score_model`` (``model_grader.ChatCompletion``; the caller binds it to the
tenant or the job) and the sandbox's limits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from trainers.common.graders import formula, metrics, sandbox, templates
from trainers.common.graders.model_grader import (
    ChatCompletion,
    ChatCompletionError,
    ChatRequest,
    clip,
    parse_score,
)
from trainers.common.graders.models import (
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)


@dataclass
class GradeErrors:
    """OpenAI's ``metadata.errors`` of a graders run."""

    formula_parse_error: bool = False
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False
    invalid_variable_error: bool = False
    other_error: bool = False
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    model_grader_server_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_server_error_details: str | None = None

    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def merge(self, other: GradeErrors) -> None:
        """Keep every flag ``other`` raised (a ``multi`` reports its sub-graders' errors)."""
        for f in fields(self):
            value = getattr(other, f.name)
            if value and not getattr(self, f.name):
                setattr(self, f.name, value)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class GradeResult:
    """One sample's grade, in the shape of OpenAI's ``graders/run`` answer (:meth:`response`)."""

    name: str
    type: str
    reward: float = 0.0
    errors: GradeErrors = field(default_factory=GradeErrors)
    execution_time: float = 0.0
    scores: dict[str, Any] = field(default_factory=dict)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    token_usage: int | None = None
    sampled_model_name: str | None = None
    model_token_usage: dict[str, dict[str, int]] = field(default_factory=dict)

    def response(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "metadata": {"name": self.name, "type": self.type, "errors": self.errors.as_dict(),
                         "execution_time": self.execution_time, "scores": self.scores,
                         "token_usage": self.token_usage, "sampled_model_name": self.sampled_model_name},
            "sub_rewards": self.sub_rewards,
            "model_grader_token_usage_per_model": self.model_token_usage,
        }


@dataclass(frozen=True)
class GradingContext:
    """What grading needs from its caller (see the module doc)."""

    chat: ChatCompletion | None = None
    sandbox: sandbox.SandboxLimits = field(default_factory=sandbox.SandboxLimits)


def grade(grader: Any, sample: dict[str, Any], item: Any, context: GradingContext) -> GradeResult:
    """One sample's grade (see :func:`grade_batch`)."""
    return grade_batch(grader, [sample], [item], context)[0]


def grade_batch(grader: Any, samples: Sequence[dict[str, Any]], items: Sequence[Any],
                context: GradingContext) -> list[GradeResult]:
    """One :class:`GradeResult` per ``(sample, item)``; never raises for a sample."""
    if len(samples) != len(items):
        raise ValueError("one item per sample")
    if isinstance(grader, MultiGrader):
        return _multi(grader, samples, items, context)
    if isinstance(grader, PythonGrader):
        return _python(grader, samples, items, context)
    return [_timed(_leaf, grader, sample, item, context) for sample, item in zip(samples, items, strict=True)]


def _timed(function: Any, grader: Any, sample: dict[str, Any], item: Any, context: GradingContext) -> GradeResult:
    started = time.perf_counter()
    result = function(grader, sample, item, context)
    result.execution_time = time.perf_counter() - started
    return result


def _leaf(grader: Any, sample: dict[str, Any], item: Any, context: GradingContext) -> GradeResult:
    result = GradeResult(grader.display_name(), grader.type)
    try:
        if isinstance(grader, StringCheckGrader):
            result.reward = _string_check(grader, sample, item)
        elif isinstance(grader, TextSimilarityGrader):
            text, reference = templates.render(grader.input, item, sample), templates.render(grader.reference, item,
                                                                                              sample)
            result.reward = metrics.similarity(grader.evaluation_metric, text, reference)
        else:
            _score_model(grader, sample, item, context, result)
    except templates.MissingVariable:
        result.errors.invalid_variable_error = True
    except templates.SampleNotJSON:
        result.errors.sample_parse_error = True
    return result


def _string_check(grader: StringCheckGrader, sample: dict[str, Any], item: Any) -> float:
    text = templates.render(grader.input, item, sample)
    reference = templates.render(grader.reference, item, sample)
    passed = {
        "eq": lambda: text == reference,
        "ne": lambda: text != reference,
        "like": lambda: reference in text,
        "ilike": lambda: reference.lower() in text.lower(),
    }[grader.operation]()
    return 1.0 if passed else 0.0


def _score_model(grader: ScoreModelGrader, sample: dict[str, Any], item: Any, context: GradingContext,
                 result: GradeResult) -> None:
    messages = [{"role": message.role,
                 "content": "".join(templates.render(text, item, sample) for text in message.texts())}
                for message in grader.input]
    params = grader.sampling_params
    request = ChatRequest(model=grader.model, messages=messages,
                          temperature=params.temperature if params else None, top_p=params.top_p if params else None,
                          seed=params.seed if params else None,
                          max_completion_tokens=params.max_completions_tokens if params else None)
    if context.chat is None:
        result.errors.model_grader_server_error = True
        result.errors.model_grader_server_error_details = "no model is available to this grader here"
        return
    try:
        reply = context.chat(request)
    except ChatCompletionError as exc:
        result.errors.model_grader_server_error = True
        result.errors.model_grader_server_error_details = str(exc)[:1000]
        return
    result.sampled_model_name = reply.model
    if reply.usage:
        result.token_usage = reply.usage.get("total_tokens")
        result.model_token_usage = {reply.model: dict(reply.usage)}
    if reply.refusal:
        result.errors.model_grader_refusal_error = True
        return
    score = parse_score(reply.content)
    if score is None:
        result.errors.model_grader_parse_error = True
        return
    result.reward = clip(score, *grader.score_range())


def _python(grader: PythonGrader, samples: Sequence[dict[str, Any]], items: Sequence[Any],
            context: GradingContext) -> list[GradeResult]:
    started = time.perf_counter()
    outcomes = sandbox.grade_in_sandbox(grader.source, list(zip(samples, items, strict=True)), context.sandbox)
    each = (time.perf_counter() - started) / max(len(samples), 1)
    results = []
    for outcome in outcomes:
        result = GradeResult(grader.display_name(), grader.type, execution_time=each)
        if outcome.reward is not None:
            result.reward = outcome.reward
        elif outcome.sandbox_error:
            result.errors.python_grader_server_error = True
            result.errors.python_grader_server_error_type = outcome.code
            result.errors.python_grader_runtime_error_details = outcome.details
        else:
            result.errors.python_grader_runtime_error = True
            result.errors.python_grader_runtime_error_details = outcome.details
        results.append(result)
    return results


def _multi(grader: MultiGrader, samples: Sequence[dict[str, Any]], items: Sequence[Any],
           context: GradingContext) -> list[GradeResult]:
    started = time.perf_counter()
    parts = {key: grade_batch(sub, samples, items, context) for key, sub in grader.graders.items()}
    each = (time.perf_counter() - started) / max(len(samples), 1)
    results = []
    for index in range(len(samples)):
        result = GradeResult(grader.display_name(), grader.type, execution_time=each)
        for key, graded in parts.items():
            part = graded[index]
            result.sub_rewards[key] = part.reward
            result.errors.merge(part.errors)
            for model, usage in part.model_token_usage.items():
                totals = result.model_token_usage.setdefault(model, {})
                for name, count in usage.items():
                    totals[name] = totals.get(name, 0) + count
            if part.token_usage is not None:
                result.token_usage = (result.token_usage or 0) + part.token_usage
            result.sampled_model_name = result.sampled_model_name or part.sampled_model_name
        result.scores = dict(result.sub_rewards)
        try:
            result.reward = formula.evaluate(grader.calculate_output, result.sub_rewards)
        except formula.FormulaError:
            result.errors.formula_parse_error = True
        except formula.FormulaRuntimeError:
            result.errors.other_error = True
        results.append(result)
    return results
