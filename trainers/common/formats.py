"""Training-file formats: parse and validate JSONL into one canonical example shape.

Pure Python (stdlib only) so that the service (``api``) validates uploads with exactly
the code the trainers use to read them: a file that passes :func:`validate_jsonl` is a
file :func:`read_examples` reads without error.

Three formats are accepted, one per file (the first valid line decides):

``chat``
    ``{"messages": [{"role": "system|user|assistant", "content": "...", "weight": 0|1}]}``
    ``weight`` is optional and only allowed on assistant turns (``0`` = not trained on).
``prompt_completion``
    ``{"prompt": "...", "completion": "..."}`` -> user(prompt) + assistant(completion).
    An empty prompt is allowed (then the example is the assistant turn alone).
``alpaca``
    ``{"instruction": "...", "input": "..." (optional), "output": "..."}`` ->
    user(instruction + "\\n\\n" + input, or instruction alone when input is empty) +
    assistant(output).

Unknown extra keys are ignored (OpenAI files often carry ``name`` or metadata).
Blank lines are ignored; line numbers are 1-based; a UTF-8 BOM at the start is allowed;
``\\r\\n`` line endings are accepted.

Stable problem codes (``FileProblem.code``), part of the public API:

==================== ===================================================================
code                 meaning
==================== ===================================================================
not_utf8             the line is not valid UTF-8
empty_file           the file has no non-blank line
invalid_json         the line is not valid JSON
not_an_object        the line is JSON but not an object (``{...}``)
unknown_format       the first object matches none of the three formats
mixed_formats        the object is of another format than the file's first example
missing_messages     a chat file's line has no ``messages`` key
invalid_messages     ``messages`` is not a non-empty list of objects with a string role
unrecognized_role    a message role other than system/user/assistant
missing_content      a message has no ``content`` (or it is null)
empty_content        a content/completion/instruction/output is empty or whitespace only
invalid_weight       ``weight`` is not 0 or 1, or is set on a non-assistant message
no_assistant_message no assistant message with weight 1 (nothing to train on)
missing_field        a prompt/completion or alpaca line lacks a required field
invalid_type         a field has the wrong JSON type (e.g. a number where text is needed)
too_few_examples     fewer valid examples than required (``min_examples``)
line_too_long        the line is longer than ``MAX_LINE_BYTES``
==================== ===================================================================

``n_tokens_estimate`` uses the chars/4 rule (about four characters per token for English
text with BPE tokenizers): ``ceil(total content characters / 4)``. It is an estimate for
quotas and ETAs only; trainers count real tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Format = Literal["chat", "prompt_completion", "alpaca"]
Role = Literal["system", "user", "assistant", "tool"]

FORMATS: tuple[str, ...] = ("chat", "prompt_completion", "alpaca")
ROLES: tuple[str, ...] = ("system", "user", "assistant")
MAX_LINE_BYTES = 8 * 1024 * 1024
"""Longest accepted line; larger lines are almost always a broken export, not one example."""

PROBLEM_CODES: tuple[str, ...] = (
    "not_utf8",
    "empty_file",
    "invalid_json",
    "not_an_object",
    "unknown_format",
    "mixed_formats",
    "missing_messages",
    "invalid_messages",
    "unrecognized_role",
    "missing_content",
    "empty_content",
    "invalid_weight",
    "no_assistant_message",
    "missing_field",
    "invalid_type",
    "too_few_examples",
    "line_too_long",
)


@dataclass(frozen=True)
class ToolCall:
    """One function call an assistant turn makes; ``arguments`` is the JSON text as given."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One turn of the canonical example; ``weight`` 0 masks an assistant turn from the loss.

    An assistant turn may carry ``tool_calls`` (then ``content`` may be empty); a ``tool``
    turn answers the call named by ``tool_call_id``.
    """

    role: Role
    content: str
    weight: int = 1
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class Example:
    """The canonical training example every supervised format is converted to.

    ``tools`` holds the file line's tool (function) definitions as given, in OpenAI's
    ``{"type": "function", "function": {...}}`` shape, for the chat template to render.
    """

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class PreferenceExample:
    """One DPO example: a prompt conversation and a preferred and a rejected assistant answer."""

    prompt: tuple[Message, ...]
    chosen: Message
    rejected: Message
    tools: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class FileProblem:
    """One problem in a file: where (1-based line, None = whole file), a stable code, a message."""

    line: int | None
    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message}


@dataclass
class ValidationReport:
    """Result of :func:`validate_jsonl`. ``errors`` holds at most ``max_errors`` problems;
    ``n_errors`` counts all of them."""

    format: Format | None = None
    n_examples: int = 0
    n_tokens_estimate: int = 0
    errors: list[FileProblem] = field(default_factory=list)
    n_errors: int = 0

    @property
    def ok(self) -> bool:
        return self.n_errors == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "format": self.format,
            "n_examples": self.n_examples,
            "n_tokens_estimate": self.n_tokens_estimate,
            "n_errors": self.n_errors,
            "errors": [e.to_dict() for e in self.errors],
        }


class FormatError(ValueError):
    """A line that cannot become an :class:`Example`; carries the stable code and line."""

    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{message} [{code}]")
        self.code = code
        self.message = message
        self.line = line


def detect_format(obj: Any) -> Format | None:
    """Which format a parsed JSON line is written in, from its keys; None if none matches."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if "instruction" in obj or "output" in obj:
        return "alpaca"
    return None


def parse_example(obj: Any, fmt: Format) -> Example:
    """Convert one parsed JSON line of format ``fmt`` to an :class:`Example`.

    Raises:
        FormatError: with a stable code if the object is not a valid example of ``fmt``.
    """
    if not isinstance(obj, dict):
        raise FormatError("not_an_object", f"expected a JSON object, got {_json_type(obj)}")
    found = detect_format(obj)
    if found is None:
        if fmt == "chat":
            raise FormatError("missing_messages", "missing the 'messages' list")
        raise FormatError("missing_field", f"none of the {_FIELDS[fmt]} fields is present")
    if found != fmt:
        raise FormatError(
            "mixed_formats", f"this line is {found} but the file is {fmt}; use one format per file"
        )
    if fmt == "chat":
        return _parse_chat(obj)
    if fmt == "prompt_completion":
        return _parse_prompt_completion(obj)
    return _parse_alpaca(obj)


_FIELDS: dict[str, str] = {
    "chat": "'messages'",
    "prompt_completion": "'prompt'/'completion'",
    "alpaca": "'instruction'/'input'/'output'",
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _text_field(obj: dict[str, Any], key: str, *, required: bool, allow_empty: bool) -> str:
    if key not in obj or obj[key] is None:
        if required:
            raise FormatError("missing_field", f"missing the '{key}' field")
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise FormatError("invalid_type", f"'{key}' must be a string, got {_json_type(value)}")
    if not allow_empty and not value.strip():
        raise FormatError("empty_content", f"'{key}' is empty")
    return value


def _parse_chat(obj: dict[str, Any]) -> Example:
    raw = obj["messages"]
    if not isinstance(raw, list) or not raw:
        raise FormatError("invalid_messages", "'messages' must be a non-empty array of messages")
    messages: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise FormatError("invalid_messages", f"{where} must be an object, got {_json_type(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise FormatError("invalid_messages", f"{where} needs a string 'role'")
        if role not in ROLES:
            raise FormatError(
                "unrecognized_role", f"{where}.role '{role}' is not one of system, user, assistant"
            )
        if m.get("content") is None:
            raise FormatError("missing_content", f"{where} has no 'content'")
        content = m["content"]
        if not isinstance(content, str):
            raise FormatError(
                "invalid_type", f"{where}.content must be a string, got {_json_type(content)}"
            )
        if not content.strip():
            raise FormatError("empty_content", f"{where}.content is empty")
        weight = 1
        if "weight" in m:
            w = m["weight"]
            if role != "assistant":
                raise FormatError("invalid_weight", f"{where}: 'weight' is only allowed on assistant messages")
            if isinstance(w, bool) or w not in (0, 1):
                raise FormatError("invalid_weight", f"{where}.weight must be 0 or 1, got {w!r}")
            weight = int(w)
        messages.append(Message(role=role, content=content, weight=weight))  # type: ignore[arg-type]
    if not any(m.role == "assistant" and m.weight == 1 for m in messages):
        raise FormatError(
            "no_assistant_message", "needs at least one assistant message with weight 1 to train on"
        )
    return Example(messages=tuple(messages))


def _parse_prompt_completion(obj: dict[str, Any]) -> Example:
    prompt = _text_field(obj, "prompt", required=True, allow_empty=True)
    completion = _text_field(obj, "completion", required=True, allow_empty=False)
    messages = [Message("user", prompt)] if prompt.strip() else []
    messages.append(Message("assistant", completion))
    return Example(messages=tuple(messages))


def _parse_alpaca(obj: dict[str, Any]) -> Example:
    instruction = _text_field(obj, "instruction", required=True, allow_empty=False)
    extra = _text_field(obj, "input", required=False, allow_empty=True)
    output = _text_field(obj, "output", required=True, allow_empty=False)
    user = instruction + ("\n\n" + extra if extra.strip() else "")
    return Example(messages=(Message("user", user), Message("assistant", output)))


def _split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        yield number, raw.rstrip(b"\r")


def _decode_line(number: int, raw: bytes) -> Any:
    """Bytes of one non-blank line -> parsed JSON; raises FormatError with the line number."""
    if len(raw) > MAX_LINE_BYTES:
        raise FormatError(
            "line_too_long", f"line is {len(raw)} bytes, the limit is {MAX_LINE_BYTES}", number
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError("not_utf8", f"not valid UTF-8 at byte {exc.start}", number) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError("invalid_json", f"invalid JSON: {exc.msg} (column {exc.colno})", number) from None
    except RecursionError:
        # The parser recurses per nesting level: thousands of "[" would otherwise end the
        # whole validation (the file would stay "uploaded" for good), not just this line.
        raise FormatError("invalid_json", "invalid JSON: nested too deeply", number) from None


def _content_chars(example: Example) -> int:
    return sum(len(m.content) for m in example.messages)


def validate_jsonl(data: bytes, *, max_errors: int = 50, min_examples: int = 1) -> ValidationReport:
    """Validate a whole JSONL training file.

    Args:
        data: the file's bytes.
        max_errors: keep at most this many problems in ``errors`` (all are counted).
        min_examples: fewer valid examples than this is a ``too_few_examples`` problem.

    Returns:
        A report; ``report.ok`` is True iff the file can be trained on as is.
    """
    report = ValidationReport()
    chars = 0
    saw_line = False

    def problem(line: int | None, code: str, message: str) -> None:
        report.n_errors += 1
        if len(report.errors) < max_errors:
            report.errors.append(FileProblem(line, code, message))

    for number, raw in _split_lines(data):
        if not raw.strip():
            continue
        saw_line = True
        try:
            obj = _decode_line(number, raw)
            if not isinstance(obj, dict):
                raise FormatError("not_an_object", f"expected a JSON object, got {_json_type(obj)}")
            if report.format is None:
                found = detect_format(obj)
                if found is None:
                    raise FormatError(
                        "unknown_format",
                        "not a chat ('messages'), prompt/completion or alpaca "
                        "('instruction'/'output') example",
                    )
                example = parse_example(obj, found)
                report.format = found  # only a valid line fixes the file's format
            else:
                example = parse_example(obj, report.format)
        except FormatError as err:
            problem(number, err.code, err.message)
            continue
        report.n_examples += 1
        chars += _content_chars(example)

    if not saw_line:
        problem(None, "empty_file", "the file has no examples")
    elif report.n_examples < min_examples:
        problem(
            None,
            "too_few_examples",
            f"{report.n_examples} valid example(s); at least {min_examples} required",
        )
    report.n_tokens_estimate = math.ceil(chars / 4)
    return report


def read_examples(
    path_or_lines: str | Path | Iterable[str | bytes], fmt: Format | None = None
) -> Iterator[Example]:
    """Yield the examples of a JSONL file (a path, or an iterable of lines).

    Args:
        path_or_lines: a file path, or lines as ``str``/``bytes``.
        fmt: the file's format; None = detect it from the first non-blank line.

    Raises:
        FormatError: on the first invalid line (validate files first; the service does).
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if isinstance(path_or_lines, (str, Path)):
        with open(path_or_lines, "rb") as f:
            yield from _read_lines(enumerate(f, start=1), fmt)
    else:
        yield from _read_lines(enumerate(path_or_lines, start=1), fmt)


def _read_lines(numbered: Iterable[tuple[int, str | bytes]], fmt: Format | None) -> Iterator[Example]:
    for number, line in numbered:
        raw = line.encode("utf-8") if isinstance(line, str) else line
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        raw = raw.rstrip(b"\r\n")
        if not raw.strip():
            continue
        obj = _decode_line(number, raw)
        if fmt is None:
            fmt = detect_format(obj)
            if fmt is None:
                raise FormatError("unknown_format", "cannot tell the file's format", number)
        try:
            yield parse_example(obj, fmt)
        except FormatError as err:
            raise FormatError(err.code, err.message, number) from None
