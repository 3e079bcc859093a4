"""``score_model``: a model grades the sample, through an injected chat-completion call.

The caller supplies the model: :data:`ChatCompletion` is any function from a
:class:`ChatRequest` to a :class:`ChatReply` (raising :class:`ChatCompletionError` when
the model cannot answer). The API passes one that asks a model this service serves (the
embedded inference worker or a model's server, with the tenant's admission limits) or an
operator-allowed external OpenAI-compatible endpoint; a trainer passes one bound to its
job's credentials. Nothing here opens a connection.

The request carries OpenAI's response format (``{"result": number, "steps": [{"description",
"conclusion"}]}``); a model that cannot follow a schema may also answer a bare number. The
reward is ``result`` clipped to the grader's ``range`` (default ``[0, 1]``); any other
answer is a parse error and 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCORE_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "score", "strict": True, "schema": {
        "type": "object", "additionalProperties": False, "required": ["steps", "result"],
        "properties": {
            "steps": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["description", "conclusion"],
                "properties": {"description": {"type": "string"}, "conclusion": {"type": "string"}}}},
            "result": {"type": "number"},
        }}},
}


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion a ``score_model`` grader asks for."""

    model: str
    messages: list[dict[str, str]]
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] = field(default_factory=lambda: SCORE_RESPONSE_FORMAT)


@dataclass(frozen=True)
class ChatReply:
    """The model's message: its text (or refusal), the model that answered, token usage."""

    content: str | None
    model: str
    refusal: str | None = None
    usage: dict[str, int] | None = None


class ChatCompletionError(Exception):
    """The model could not answer (unreachable, refused the request, timed out)."""


ChatCompletion = Callable[[ChatRequest], ChatReply]


def parse_score(content: str | None) -> float | None:
    """The numeric ``result`` of a reply (JSON, or a bare number), or None."""
    if content is None:
        return None
    text = content.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("result")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)
