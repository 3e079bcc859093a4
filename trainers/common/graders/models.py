"""OpenAI's grader objects, as its API and the ``openai`` SDK write them.

``string_check``, ``text_similarity``, ``score_model``, ``python`` and ``multi`` (a formula
over named sub-graders, none of them a ``multi``). :func:`parse_grader` turns a tenant's
JSON into one of these, or raises :class:`GraderInvalid` with a stable code, a message and
the field (``param``) at fault: the shape, every template (``templates``), a ``multi``'s
formula (``formula``), a python grader's source (it must parse and define
``grade(sample, item)``; it is never run here), and metrics this service cannot compute.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from trainers.common.graders import formula, templates
from trainers.common.graders.metrics import METRICS, unavailable_reason
from trainers.common.graders.sandbox import MAX_SOURCE_BYTES

INVALID_GRADER = "invalid_grader"
INVALID_TEMPLATE = "invalid_grader_template"
INVALID_FORMULA = "invalid_grader_formula"
INVALID_PYTHON = "invalid_python_grader"
UNSUPPORTED_METRIC = "unsupported_evaluation_metric"


class GraderInvalid(ValueError):
    """A grader this service refuses: ``code`` (stable), ``message``, ``param`` (the field)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=256)

    def display_name(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]


class StringCheckGrader(_Grader):
    """1.0 when ``input`` and ``reference`` (both templates) compare true, else 0.0."""

    type: Literal["string_check"]
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_Grader):
    """A similarity metric (0..1) between ``input`` and ``reference`` (both templates)."""

    type: Literal["text_similarity"]
    input: str
    reference: str
    evaluation_metric: Literal["cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2",
                               "rouge_3", "rouge_4", "rouge_5", "rouge_l"]
    pass_threshold: float | None = None  # evals only; kept as given


class PythonGrader(_Grader):
    """Tenant code defining ``grade(sample, item) -> float``, run in the sandbox."""

    type: Literal["python"]
    source: str = Field(max_length=MAX_SOURCE_BYTES)
    image_tag: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ScoreModelMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system", "developer"]
    content: str | ContentPart | list[ContentPart]
    type: Literal["message"] | None = None

    def texts(self) -> list[str]:
        """The text of each part (templates); other parts are refused by ``_text_only``."""
        if isinstance(self.content, str):
            return [self.content]
        parts = self.content if isinstance(self.content, list) else [self.content]
        return [part.text or "" for part in parts]

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        parts = [] if isinstance(content, str) else content if isinstance(content, list) else [content]
        for part in parts:
            if part.type not in ("input_text", "output_text") or part.text is None:
                raise ValueError(f"content parts of type '{part.type}' are not supported: "
                                 "the graders' models read text only ('input_text', 'output_text')")
        return content


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    temperature: float | None = Field(None, ge=0, le=2)
    max_completions_tokens: int | None = Field(None, ge=1)
    reasoning_effort: str | None = None


class ScoreModelGrader(_Grader):
    """A model's numeric answer to ``input`` (templated messages), clipped to ``range``."""

    type: Literal["score_model"]
    model: str = Field(min_length=1)
    input: list[ScoreModelMessage] = Field(min_length=1)
    range: list[float] | None = None
    sampling_params: SamplingParams | None = None
    pass_threshold: float | None = None

    @field_validator("range")
    @classmethod
    def _two_ordered_numbers(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (len(value) != 2 or not value[0] < value[1]):
            raise ValueError("range must be two numbers [low, high] with low < high")
        return value

    def score_range(self) -> tuple[float, float]:
        low, high = self.range or (0.0, 1.0)
        return float(low), float(high)


LeafGrader = Annotated[StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader,
                       Field(discriminator="type")]


class MultiGrader(_Grader):
    """``calculate_output`` over the rewards of ``graders`` (their keys are its variables)."""

    type: Literal["multi"]
    graders: dict[str, LeafGrader] = Field(min_length=1)
    calculate_output: str = Field(min_length=1, max_length=formula.MAX_LENGTH)

    @model_validator(mode="before")
    @classmethod
    def _no_nested_multi(cls, data: Any) -> Any:
        graders = data.get("graders") if isinstance(data, dict) else None
        if isinstance(graders, dict):
            for key, grader in graders.items():
                if isinstance(grader, dict) and grader.get("type") == "multi":
                    raise GraderInvalid(INVALID_GRADER, "A multi grader cannot contain another multi grader.",
                                        f"grader.graders.{key}")
        return data


Grader = Annotated[StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader,
                   Field(discriminator="type")]
_GRADER: TypeAdapter[Any] = TypeAdapter(Grader)
GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "multi")


def parse_grader(data: Any, *, param: str = "grader") -> Any:
    """``data`` as a grader object, fully checked (see the module doc), or ``GraderInvalid``."""
    if not isinstance(data, dict):
        raise GraderInvalid(INVALID_GRADER, "The grader must be a JSON object.", param)
    if data.get("type") not in GRADER_TYPES:
        raise GraderInvalid(INVALID_GRADER, f"grader type must be one of: {', '.join(GRADER_TYPES)}.",
                            f"{param}.type")
    try:
        grader = _GRADER.validate_python(data)
    except ValidationError as exc:
        raise _invalid(exc, param) from exc
    check_grader(grader, param)
    return grader


def uses_model_grader(data: Any) -> bool:
    """Whether the grader JSON is, or (a ``multi``) contains, a ``score_model`` grader: one
    that needs a chat-completion endpoint (job creation refuses it for training, and the
    trainers, which no model endpoint reaches, refuse it too)."""
    subs = data.get("graders") if isinstance(data, dict) else None
    leaves = [data] + (list(subs.values()) if isinstance(subs, dict) else [])
    return any(isinstance(g, dict) and g.get("type") == "score_model" for g in leaves)


def check_grader(grader: Any, param: str = "grader") -> None:
    """What the shape cannot say: templates, formulas, python sources, metrics."""
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            if not key.isidentifier():
                raise GraderInvalid(INVALID_GRADER, f"The sub-grader key '{key}' must be a name a formula can use "
                                    "(letters, digits, underscores).", f"{param}.graders")
            check_grader(sub, f"{param}.graders.{key}")
        try:
            formula.check(grader.calculate_output, set(grader.graders))
        except formula.FormulaError as exc:
            raise GraderInvalid(INVALID_FORMULA, str(exc), f"{param}.calculate_output") from exc
    elif isinstance(grader, PythonGrader):
        check_python_source(grader.source, f"{param}.source")
    elif isinstance(grader, ScoreModelGrader):
        for index, message in enumerate(grader.input):
            for text in message.texts():
                _check_templates(text, f"{param}.input[{index}].content")
    else:
        _check_templates(grader.input, f"{param}.input")
        _check_templates(grader.reference, f"{param}.reference")
        if isinstance(grader, TextSimilarityGrader):
            reason = unavailable_reason(grader.evaluation_metric)
            if reason is not None:
                raise GraderInvalid(UNSUPPORTED_METRIC, reason, f"{param}.evaluation_metric")
            assert grader.evaluation_metric in METRICS


def item_references(grader: Any, param: str = "grader") -> Iterator[tuple[str, str]]:
    """``(key, param)`` for each ``{{item.<key>}}`` in a checked grader's templates: the
    top-level data-row keys it reads, and the field that reads each. A ``python`` grader's
    reads are its code's, unknown here."""
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            yield from item_references(sub, f"{param}.graders.{key}")
        return
    if isinstance(grader, ScoreModelGrader):
        texts = [(text, f"{param}.input[{index}].content")
                 for index, message in enumerate(grader.input) for text in message.texts()]
    elif isinstance(grader, (StringCheckGrader, TextSimilarityGrader)):
        texts = [(grader.input, f"{param}.input"), (grader.reference, f"{param}.reference")]
    else:
        return
    for text, where in texts:
        for expression in templates.expressions(text):
            namespace, steps = templates.parse_path(expression)
            if namespace == "item" and isinstance(steps[0], str):
                yield steps[0], where


def check_python_source(source: str, param: str) -> None:
    """The source parses and defines ``grade`` with exactly two parameters. Parsed only:
    tenant code runs in the sandbox, never here."""
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise GraderInvalid(INVALID_PYTHON, f"The source is over {MAX_SOURCE_BYTES // 1024} kB.", param)
    try:
        tree = ast.parse(source, filename="grader.py")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise GraderInvalid(INVALID_PYTHON, f"The source does not compile{where}: {exc}", param) from exc
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "grade":
            arguments = node.args
            positional = len(arguments.posonlyargs) + len(arguments.args)
            if positional == 2 or (positional < 2 and arguments.vararg is not None):
                return
            raise GraderInvalid(INVALID_PYTHON, f"grade must take exactly two arguments (sample, item); "
                                f"it takes {positional}.", param)
    raise GraderInvalid(INVALID_PYTHON, "The source must define a function grade(sample, item) at its top level.",
                        param)


def _check_templates(text: str, param: str) -> None:
    try:
        templates.check(text)
    except templates.TemplateError as exc:
        raise GraderInvalid(INVALID_TEMPLATE, str(exc), param) from exc


def _invalid(exc: ValidationError, param: str) -> GraderInvalid:
    first = exc.errors()[0]
    inner = first.get("ctx", {}).get("error")
    if isinstance(inner, GraderInvalid):
        return inner
    # Drop the union's tags ("string_check", "function-after[...]") from the location.
    location = [str(part) for part in first["loc"] if str(part) not in GRADER_TYPES and not str(part).endswith("]")]
    path = param
    for part in location:
        path += f"[{part}]" if part.isdigit() else f".{part}"
    if first["type"] == "missing":
        message = f"Missing required parameter: '{path}'."
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized grader field: '{path}'."
    else:
        message = f"Invalid value for '{path}': {first['msg']}"
    return GraderInvalid(INVALID_GRADER, message, path)
