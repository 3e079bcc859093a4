"""The ``sample`` namespace: what a grader sees of the model's completion.

OpenAI fills it from the sampled completion: ``output_text`` (the text), ``output_json``
(the text parsed, when it is a JSON object or array; else None), ``output_tools`` (the
message's ``tool_calls``), ``choices`` (chat-completion choices) and ``output_audio``.
Templates read it (``{{sample.output_text}}``) and python graders receive it as their
first argument.
"""

from __future__ import annotations

import json
from typing import Any


def parsed_json(text: str) -> Any:
    """``text`` as a JSON object or array, else None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, (dict, list)) else None


def sample_namespace(output_text: str, *, tool_calls: list[dict[str, Any]] | None = None,
                     finish_reason: str = "stop") -> dict[str, Any]:
    """The ``sample`` of one completion whose message text is ``output_text``."""
    message: dict[str, Any] = {"role": "assistant", "content": output_text, "tool_calls": tool_calls or None}
    return {
        "output_text": output_text,
        "output_json": parsed_json(output_text),
        "output_tools": list(tool_calls or []),
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "output_audio": None,
    }
