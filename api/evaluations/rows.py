"""The rows an evaluation asks the models: a validated file's first lines as prompts,
references and grader items (pure; the file's bytes come in as chunks).

Each line is read as the trainers read it (``trainers.common.formats.parse_example``), so
what an evaluation asks is what a job on the same file trained on:

- a supervised line (``chat``, ``prompt_completion``, ``alpaca``, ``sharegpt``) is split at
  its last assistant turn: the messages before it are the prompt (earlier answers
  included), its content the reference;
- a ``reinforcement`` line is all prompt and has no reference: its grader reads what the
  line holds (``{{item.<key>}}``), as in reinforcement fine-tuning.

The grader's ``item`` is the line's JSON object with ``reference`` set to the reference
(a line's own ``reference`` key gives way), so the default grader, ``string_check`` ``eq``
of ``{{sample.output_text}}`` and ``{{item.reference}}``, is exact match. Prompts are
OpenAI chat messages, as a client sends them to ``/v1/chat/completions`` (tool-call
arguments as their JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainers.common.formats import (
    SUPERVISED_FORMATS,
    Example,
    FormatError,
    Message,
    ReinforcementExample,
    parse_example,
    split_lines,
)

EVALUATED_FORMATS = (*SUPERVISED_FORMATS, "reinforcement")


@dataclass(frozen=True)
class EvaluationRow:
    """One line: what the models are asked, what the grader compares their answers with."""

    line: int
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    reference: str | None
    item: dict[str, Any]


def openai_message(message: Message) -> dict[str, Any]:
    """A canonical message as OpenAI's chat API takes it."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def evaluation_row(line: int, obj: dict[str, Any], fmt: str) -> EvaluationRow:
    """One parsed line of a ``fmt`` file as an :class:`EvaluationRow` (see the module doc)."""
    example = parse_example(obj, fmt)  # type: ignore[arg-type]
    if isinstance(example, ReinforcementExample):
        return EvaluationRow(line, tuple(openai_message(m) for m in example.prompt), example.tools, None,
                             dict(example.item))
    if not isinstance(example, Example):
        raise FormatError("invalid_type", f"a {fmt} line cannot be evaluated", line)
    last = max(i for i, m in enumerate(example.messages) if m.role == "assistant")
    reference = example.messages[last].content
    return EvaluationRow(line, tuple(openai_message(m) for m in example.messages[:last]), example.tools, reference,
                         {**obj, "reference": reference})


def evaluation_rows(chunks: Iterable[bytes], fmt: str, limit: int) -> list[EvaluationRow]:
    """The first ``limit`` rows of a validated file of format ``fmt``, read in ``chunks``.

    Raises:
        FormatError: a line that is not a valid ``fmt`` example (the file was validated, so
            only a file changed under the service).
    """
    if fmt not in EVALUATED_FORMATS:
        raise ValueError(f"{fmt} files cannot be evaluated")
    rows: list[EvaluationRow] = []
    for number, raw, _length in split_lines(chunks):
        if len(rows) >= limit:
            break
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise FormatError("invalid_json", f"invalid JSON: {exc}", number) from None
        try:
            rows.append(evaluation_row(number, obj, fmt))
        except FormatError as exc:
            raise FormatError(exc.code, exc.message, number) from None
    return rows
