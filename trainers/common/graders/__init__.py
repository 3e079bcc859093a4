"""Graders as OpenAI defines them, for reinforcement fine-tuning and ``graders/run``.

Pure Python plus the metric and sandbox libraries, so the API (``api.graders``) and the
trainers import the same code (trainers never import the API):

- ``models``: the grader objects and :func:`parse_grader` (validation, stable codes);
- ``templates``: ``{{item.x}}`` / ``{{sample.output_text}}``; ``samples``: the ``sample``
  namespace of a completion;
- ``metrics``: ``text_similarity``'s metrics; ``formula``: a ``multi``'s
  ``calculate_output``;
- ``model_grader``: ``score_model``'s injected chat-completion call;
- ``sandbox`` (and ``sandbox_child``): where ``python`` graders run;
- ``grading``: :func:`grade_batch`, the call a training loop makes per batch.
"""

from trainers.common.graders.grading import (
    GradeErrors,
    GradeResult,
    GradingContext,
    grade,
    grade_batch,
)
from trainers.common.graders.model_grader import (
    ChatCompletion,
    ChatCompletionError,
    ChatReply,
    ChatRequest,
)
from trainers.common.graders.models import GraderInvalid, parse_grader
from trainers.common.graders.samples import sample_namespace
from trainers.common.graders.sandbox import SandboxLimits

__all__ = [
    "ChatCompletion", "ChatCompletionError", "ChatReply", "ChatRequest", "GradeErrors", "GradeResult",
    "GraderInvalid", "GradingContext", "SandboxLimits", "grade", "grade_batch", "parse_grader", "sample_namespace",
]
