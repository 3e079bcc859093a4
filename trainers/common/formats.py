"""Training-file formats: parse and validate JSONL into one canonical example shape.

Pure Python (stdlib only) so that the service (``api``) validates uploads with exactly
the code the trainers use to read them: a file that passes :func:`validate_jsonl` is a
file :func:`read_examples` (or, for preference data, :func:`read_preference_examples`;
for reinforcement prompts, :func:`read_reinforcement_examples`) reads without error.

Six formats are accepted, one per file (the first valid line decides):

``chat`` (OpenAI's chat fine-tuning format)
    ``{"messages": [...], "tools": [...], "parallel_tool_calls": true}``; ``tools`` and
    ``parallel_tool_calls`` are optional, and the legacy ``functions`` list is accepted
    in place of ``tools`` (each function becomes ``{"type": "function", "function": f}``).
    A message has ``role`` (system, user, assistant or tool) and may have only the keys
    ``content``, ``name``, ``tool_calls``, ``tool_call_id``, ``function_call`` and
    ``weight``; any other key is an error, as in OpenAI's own checker.

    - ``content`` is a string or an array of ``{"type": "text", "text": ...}`` parts,
      concatenated as they are (no separator added). Other part types (images, audio,
      files, refusals) are refused: this service trains text-only models.
    - an assistant message may carry ``tool_calls``: ``[{"id": ..., "type": "function",
      "function": {"name": ..., "arguments": "<JSON object as text>"}}]`` (``id`` and
      ``type`` are optional); then its ``content`` may be null, empty or absent. The
      legacy ``function_call`` (``{"name", "arguments"}``) is read as one tool call.
    - a ``tool`` message answers an earlier call of the same line through its
      ``tool_call_id``; its content may be empty. The legacy ``{"role": "function",
      "name": ...}`` answers the latest earlier ``function_call`` of that name and is
      read as a ``tool`` message.
    - ``weight`` is optional and only allowed on assistant turns (``0`` = not trained on).
``sharegpt``
    ``{"conversations": [{"from": "system|human|gpt", "value": "..."}]}``; ``from`` may
    also be ``user`` or ``assistant``. Other keys of a turn are ignored.
``prompt_completion``
    ``{"prompt": "...", "completion": "..."}`` -> user(prompt) + assistant(completion).
    An empty prompt is allowed (then the example is the assistant turn alone).
``alpaca``
    ``{"instruction": "...", "input": "..." (optional), "output": "..."}`` ->
    user(instruction + "\\n\\n" + input, or instruction alone when input is empty) +
    assistant(output).
``preference`` (OpenAI's DPO format, read as :class:`PreferenceExample`)
    ``{"input": {"messages": [...], "tools": [...], "parallel_tool_calls": ...},
    "preferred_output": [<assistant message>], "non_preferred_output": [<assistant
    message>]}``: the prompt's messages follow the chat rules above; each output is a
    list of exactly one assistant message (content and/or tool calls, no ``weight``).
``reinforcement`` (OpenAI's reinforcement fine-tuning format, read as :class:`ReinforcementExample`)
    ``{"messages": [...], "tools": [...], "<key>": ...}``: the prompt the model answers,
    its messages following the chat rules above and ending in a ``user`` turn (the model
    samples the assistant's answer), plus any other keys, which a grader reads as
    ``{{item.<key>}}`` (the whole line is the grader's ``item``). A ``messages`` line is
    read as reinforcement when it ends in a user turn and has no assistant turn to train on
    (none, or only ``weight`` 0 ones): a line a chat file could not hold. Once a file is
    reinforcement, every line must end in a user turn, earlier assistant turns (few-shot
    context) allowed; a multi-turn prompt on the file's first line marks its assistant
    turns ``weight: 0`` so that the line is not read as chat. ``item_keys`` in the
    validation report lists the keys every valid line has.

Unknown top-level keys are ignored (exports often carry ids or metadata). Blank lines
are ignored; line numbers are 1-based; a UTF-8 BOM at the start is allowed; ``\\r\\n``
line endings are accepted.

Stable problem codes (``FileProblem.code``), part of the public API:

========================= ==============================================================
code                      meaning
========================= ==============================================================
not_utf8                  the line is not valid UTF-8
empty_file                the file has no non-blank line
invalid_json              the line is not valid JSON
not_an_object             the line is JSON but not an object (``{...}``)
unknown_format            the first object matches none of the formats
mixed_formats             the object is of another format than the file's first example
missing_messages          a chat or reinforcement (or preference ``input``) line has no ``messages`` key
invalid_messages          ``messages``/``conversations`` is not a non-empty list of
                          objects with a string role (``from``)
unrecognized_role         a role other than system/user/assistant/tool (ShareGPT: other
                          than system/human/gpt/user/assistant)
unrecognized_key          a message has a key outside the known set
missing_content           a message has no ``content`` (or it is null) and no tool calls
empty_content             a content/completion/instruction/output is empty or whitespace only
unsupported_content_type  a content part that is not text (image, audio, file, refusal)
invalid_weight            ``weight`` is not 0 or 1, or is set on a non-assistant message
                          or on a preference output
no_assistant_message      no assistant message with weight 1 (nothing to train on)
invalid_tool_call         ``tool_calls``/``function_call`` malformed, or on a message that
                          is not an assistant's; ``tool_call_id`` on a non-tool message
missing_function_name     a tool call without a non-empty ``function.name``
invalid_arguments         a tool call's ``arguments`` is not a string holding a JSON object
unknown_tool_call_id      a tool message whose ``tool_call_id`` (legacy: ``name``) is
                          missing or matches no earlier call of the line
invalid_tools             ``tools``/``functions`` is not a list of function definitions
                          with names (or both are given)
invalid_preference_output ``preferred_output``/``non_preferred_output`` is not a list of
                          exactly one assistant message
prompt_not_user_last      a reinforcement line's ``messages`` do not end in a user turn
                          (the model samples the answer; the line must not hold one)
missing_field             a required field is missing (prompt/completion, alpaca, ``input``)
invalid_type              a field has the wrong JSON type (e.g. a number where text is needed)
too_few_examples          fewer valid examples than required (``min_examples``)
line_too_long             the line is longer than ``MAX_LINE_BYTES``
========================= ==============================================================

``n_tokens_estimate`` uses the chars/4 rule (about four characters per token for English
text with BPE tokenizers): ``ceil(characters / 4)``, counting message contents, tool-call
names and arguments and, once per example, the tool definitions as JSON (for preference
lines: the prompt and both answers; for reinforcement lines: the prompt). It is an estimate for quotas and ETAs only;
trainers count real tokens.

``token_stats`` (:class:`TokenStats`) is what the scheduler plans a job's memory and time
from: the rows, the longest row (and its line) and the total, in tokens after the chat
template. The validator knows no tokenizer, so it records an upper bound
(``method="bytes"``): a row's UTF-8 bytes (contents, tool-call names and arguments, the
tool definitions as JSON) plus the chat template's own tokens, bounded by
``TEMPLATE_ROW_TOKENS`` per row, ``TEMPLATE_TOOLS_TOKENS`` when the row defines tools and
``TEMPLATE_MESSAGE_TOKENS`` per message. It is an upper bound because byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece with byte fallback (Llama 2,
Mistral) never emit more than one token per byte of text; the template allowances cover
the role headers, special tokens and default system prompts of the common templates
(ChatML, Llama 2 and 3, Mistral) that the trainers render (``trainers.common.data``); a
base model whose template injects a longer text per row is under-counted by it. A preference row is its prompt with the
longer of its two answers (both are padded to one length in a micro batch); its total
counts that length once, as the estimator's FLOPs count a pair. ``total_tokens_estimate``
is the chars/4 rule plus the template's typical tokens: a central estimate for ETAs,
where the bound is for memory. ``method="tokenizer"`` (and ``tokenizer``, naming it) is
reserved for exact counts made with a job's base model's tokenizer; readers of the stats
(``scheduling.request.DataStats``) treat both alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Format = Literal["chat", "prompt_completion", "alpaca", "sharegpt", "preference", "reinforcement"]
Role = Literal["system", "user", "assistant", "tool"]

FORMATS: tuple[str, ...] = ("chat", "prompt_completion", "alpaca", "sharegpt", "preference", "reinforcement")
SUPERVISED_FORMATS: tuple[str, ...] = ("chat", "prompt_completion", "alpaca", "sharegpt")
"""The formats read as :class:`Example` (``preference`` is read as :class:`PreferenceExample`,
``reinforcement`` as :class:`ReinforcementExample`)."""
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
MESSAGE_KEYS: tuple[str, ...] = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call", "weight")
SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
}
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
    "unrecognized_key",
    "missing_content",
    "empty_content",
    "unsupported_content_type",
    "invalid_weight",
    "no_assistant_message",
    "invalid_tool_call",
    "missing_function_name",
    "invalid_arguments",
    "unknown_tool_call_id",
    "invalid_tools",
    "invalid_preference_output",
    "prompt_not_user_last",
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
class ReinforcementExample:
    """One reinforcement fine-tuning prompt: the conversation the model answers (ending in a
    user turn) and the line as given, the grader's ``item`` namespace."""

    prompt: tuple[Message, ...]
    item: dict[str, Any]
    tools: tuple[dict[str, Any], ...] = ()
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class FileProblem:
    """One problem in a file: where (1-based line, None = whole file), a stable code, a message."""

    line: int | None
    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message}


# Chat-template tokens the byte bound allows per row, per row with tool definitions, and
# per message (see the module docstring): role headers and end-of-turn tokens are a few
# tokens per message in the ChatML, Llama 3 and Mistral templates; a default system
# prompt (Llama 3.1's dates) stays under 64; a tool preamble under 256.
TEMPLATE_ROW_TOKENS = 64
TEMPLATE_TOOLS_TOKENS = 256
TEMPLATE_MESSAGE_TOKENS = 16
# The template's tokens as ``total_tokens_estimate`` counts them (typical, not bounds):
# ChatML's "<|im_start|>role\n ... <|im_end|>\n" is 5 tokens a message, Llama 3's
# header and end-of-turn 5; a short default system prompt about 16.
TEMPLATE_ROW_TOKENS_TYPICAL = 16
TEMPLATE_MESSAGE_TOKENS_TYPICAL = 5


@dataclass
class TokenStats:
    """A file's rows in tokens after the chat template (module docstring: ``token_stats``).

    ``method`` is ``bytes`` (an upper bound from the UTF-8 bytes) or ``tokenizer`` (counted
    with the base model's tokenizer, ``tokenizer`` naming it). Truncation to a job's
    ``max_seq_len`` is applied by whoever plans the job (the stats are per file).
    """

    method: Literal["bytes", "tokenizer"] = "bytes"
    rows: int = 0
    longest_row: int = 0
    longest_row_line: int | None = None
    total_tokens: int = 0
    total_tokens_estimate: int = 0
    tokenizer: str | None = None

    def add(self, line: int, tokens: int, estimate: int | None = None) -> None:
        self.rows += 1
        self.total_tokens += tokens
        self.total_tokens_estimate += tokens if estimate is None else estimate
        if tokens > self.longest_row:
            self.longest_row, self.longest_row_line = tokens, line

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method, "rows": self.rows, "longest_row": self.longest_row,
            "longest_row_line": self.longest_row_line, "total_tokens": self.total_tokens,
            "total_tokens_estimate": self.total_tokens_estimate,
        }
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out


def _message_bytes(m: Message) -> int:
    return len(m.content.encode("utf-8")) + sum(
        len(c.name.encode("utf-8")) + len(c.arguments.encode("utf-8")) for c in m.tool_calls)


def row_token_bound(example: AnyExample) -> tuple[int, int]:
    """(upper bound, chars/4 estimate) of one example's tokens after the chat template: a
    supervised row, a preference pair's prompt with its longer answer, or a reinforcement
    prompt (its completions are sampled: their length is the job's, not the file's)."""
    tools = json.dumps(list(example.tools), ensure_ascii=False) if example.tools else ""
    if isinstance(example, PreferenceExample):
        turns = example.prompt
        answer = max(example.chosen, example.rejected, key=_message_bytes)
        turns = (*turns, answer)
    elif isinstance(example, ReinforcementExample):
        turns = example.prompt
    else:
        turns = example.messages
    template = TEMPLATE_ROW_TOKENS + TEMPLATE_MESSAGE_TOKENS * len(turns) + (TEMPLATE_TOOLS_TOKENS if tools else 0)
    bound = len(tools.encode("utf-8")) + sum(_message_bytes(m) for m in turns) + template
    chars = len(tools) + sum(_message_chars(m) for m in turns)
    typical = TEMPLATE_ROW_TOKENS_TYPICAL + TEMPLATE_MESSAGE_TOKENS_TYPICAL * len(turns)
    return bound, math.ceil(chars / 4) + typical


@dataclass
class ValidationReport:
    """Result of :func:`validate_jsonl`. ``errors`` holds at most ``max_errors`` problems;
    ``n_errors`` counts all of them."""

    format: Format | None = None
    n_examples: int = 0
    n_tokens_estimate: int = 0
    errors: list[FileProblem] = field(default_factory=list)
    n_errors: int = 0
    item_keys: tuple[str, ...] | None = None
    """Reinforcement files only: the top-level keys every valid line has (what a grader's
    ``{{item.<key>}}`` may read on any line), sorted."""
    token_stats: TokenStats = field(default_factory=TokenStats)

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
            **({"item_keys": list(self.item_keys)} if self.item_keys is not None else {}),
            "token_stats": self.token_stats.to_dict(),
        }


class FormatError(ValueError):
    """A line that cannot become an :class:`Example`; carries the stable code and line."""

    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{message} [{code}]")
        self.code = code
        self.message = message
        self.line = line


AnyExample = Example | PreferenceExample | ReinforcementExample
# The formats whose lines hold a ``messages`` list: a line's own shape says which it is.
_MESSAGE_FORMATS = ("chat", "reinforcement")


def _is_prompt(messages: Any) -> bool:
    """Whether a ``messages`` value reads as a reinforcement prompt: ending in a user turn,
    with no assistant turn a chat example would train on (malformed lists read as chat,
    whose parser names their problem)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return False
    if messages[-1].get("role") != "user":
        return False
    return not any(m.get("role") == "assistant" and m.get("weight", 1) != 0 for m in messages)


def detect_format(obj: Any) -> Format | None:
    """Which format a parsed JSON line is written in, from its keys; None if none matches."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return "reinforcement" if _is_prompt(obj["messages"]) else "chat"
    if "conversations" in obj:
        return "sharegpt"
    if "preferred_output" in obj or "non_preferred_output" in obj:
        return "preference"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if "instruction" in obj or "output" in obj:
        return "alpaca"
    return None


def parse_example(obj: Any, fmt: Format) -> AnyExample:
    """Convert one parsed JSON line of format ``fmt`` to its canonical example.

    Returns:
        A :class:`PreferenceExample` for ``preference``, a :class:`ReinforcementExample` for
        ``reinforcement``, else an :class:`Example`.

    Raises:
        FormatError: with a stable code if the object is not a valid example of ``fmt``.
    """
    if not isinstance(obj, dict):
        raise FormatError("not_an_object", f"expected a JSON object, got {_json_type(obj)}")
    found = detect_format(obj)
    if found is None:
        if fmt in _MESSAGE_FORMATS:
            raise FormatError("missing_messages", "missing the 'messages' list")
        raise FormatError("missing_field", f"none of the {_FIELDS[fmt]} fields is present")
    if found != fmt and found in _MESSAGE_FORMATS and fmt in _MESSAGE_FORMATS:
        # A chat file keeps reading every messages line as chat (a prompt-only line is a
        # chat line with nothing to train on); a reinforcement file reads every messages line
        # as a prompt, earlier assistant turns included, and refuses one that ends in an answer.
        return _PARSERS[fmt](obj)
    if found != fmt:
        raise FormatError(
            "mixed_formats", f"this line is {found} but the file is {fmt}; use one format per file"
        )
    return _PARSERS[fmt](obj)


_FIELDS: dict[str, str] = {
    "chat": "'messages'",
    "sharegpt": "'conversations'",
    "prompt_completion": "'prompt'/'completion'",
    "alpaca": "'instruction'/'input'/'output'",
    "preference": "'input'/'preferred_output'/'non_preferred_output'",
    "reinforcement": "'messages'",
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


def _tag_of(value: Any, tag: str, where: str, code: str) -> str:
    """The string ``tag`` field that says what the object ``value`` is (a content part's
    ``type``, a message's ``role``, a ShareGPT turn's ``from``); FormatError(code) otherwise."""
    if not isinstance(value, dict):
        raise FormatError(code, f"{where} must be an object, got {_json_type(value)}")
    kind = value.get(tag)
    if not isinstance(kind, str):
        raise FormatError(code, f"{where} needs a string '{tag}'")
    return kind


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


def _content_text(value: Any, where: str) -> str:
    """A message's ``content``: a string, or text parts concatenated as they are."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise FormatError(
            "invalid_type",
            f"{where}.content must be a string or an array of text parts, got {_json_type(value)}",
        )
    texts: list[str] = []
    for j, part in enumerate(value):
        at = f"{where}.content[{j}]"
        kind = _tag_of(part, "type", at, "invalid_type")
        if kind != "text":
            raise FormatError(
                "unsupported_content_type",
                f"{at} is a '{kind}' part; only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                "can be trained on (remove image, audio and file parts)",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise FormatError("invalid_type", f"{at}.text must be a string, got {_json_type(text)}")
        texts.append(text)
    return "".join(texts)


def _arguments_text(fn: dict[str, Any], where: str) -> str:
    if "arguments" not in fn:
        raise FormatError("invalid_arguments", f"{where} has no 'arguments' (a JSON object as text)")
    args = fn["arguments"]
    if not isinstance(args, str):
        raise FormatError(
            "invalid_arguments",
            f"{where}.arguments must be a string holding a JSON object, got {_json_type(args)}",
        )
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError as exc:
        raise FormatError(
            "invalid_arguments", f"{where}.arguments is not valid JSON: {exc.msg} (column {exc.colno})"
        ) from None
    except RecursionError:
        raise FormatError("invalid_arguments", f"{where}.arguments is nested too deeply") from None
    if not isinstance(parsed, dict):
        raise FormatError(
            "invalid_arguments", f"{where}.arguments must encode a JSON object, got {_json_type(parsed)}"
        )
    return args


def _function_name(fn: dict[str, Any], where: str) -> str:
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise FormatError("missing_function_name", f"{where} needs a non-empty string 'name'")
    return name


class _LineMessages:
    """Parses the messages of one line, remembering its tool calls so that a tool message
    can be checked against the calls made before it."""

    def __init__(self) -> None:
        self.call_ids: set[str] = set()
        self.legacy_calls: dict[str, str] = {}  # function name -> id of its latest function_call
        self._n_new_ids = 0

    def parse_list(self, raw: Any, where: str) -> tuple[Message, ...]:
        if not isinstance(raw, list) or not raw:
            raise FormatError("invalid_messages", f"'{where}' must be a non-empty array of messages")
        return tuple(self.parse(m, f"{where}[{i}]") for i, m in enumerate(raw))

    def parse(self, m: Any, where: str) -> Message:
        role = _tag_of(m, "role", where, "invalid_messages")
        if role not in ROLES and role != "function":
            raise FormatError(
                "unrecognized_role", f"{where}.role '{role}' is not one of system, user, assistant, tool"
            )
        unknown = [k for k in m if k not in MESSAGE_KEYS]
        if unknown:
            raise FormatError(
                "unrecognized_key",
                f"{where} has the unrecognized key(s) {', '.join(repr(k) for k in unknown)}; a message "
                f"may only have {', '.join(MESSAGE_KEYS)}",
            )
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise FormatError("invalid_type", f"{where}.name must be a string, got {_json_type(name)}")
        calls = self._tool_calls(m, role, where)
        if m.get("content") is None:
            if not calls:
                raise FormatError("missing_content", f"{where} has no 'content'")
            content = ""
        else:
            content = _content_text(m["content"], where)
        if not content.strip() and not calls and role not in ("tool", "function"):
            raise FormatError("empty_content", f"{where}.content is empty")
        weight = 1
        if "weight" in m:
            w = m["weight"]
            if role != "assistant":
                raise FormatError("invalid_weight", f"{where}: 'weight' is only allowed on assistant messages")
            if isinstance(w, bool) or w not in (0, 1):
                raise FormatError("invalid_weight", f"{where}.weight must be 0 or 1, got {w!r}")
            weight = int(w)
        call_id = self._answered_call(m, role, name, where)
        return Message(
            role="tool" if role == "function" else role,  # type: ignore[arg-type]
            content=content,
            weight=weight,
            name=name,
            tool_calls=calls,
            tool_call_id=call_id,
        )

    def _tool_calls(self, m: dict[str, Any], role: str, where: str) -> tuple[ToolCall, ...]:
        raw, legacy = m.get("tool_calls"), m.get("function_call")
        if raw is None and legacy is None:
            return ()
        if role != "assistant":
            raise FormatError("invalid_tool_call", f"{where}: only assistant messages make tool calls")
        if raw is not None and legacy is not None:
            raise FormatError("invalid_tool_call",
                              f"{where}: give 'tool_calls' or the legacy 'function_call', not both")
        if legacy is not None:
            at = f"{where}.function_call"
            if not isinstance(legacy, dict):
                raise FormatError("invalid_tool_call", f"{at} must be an object, got {_json_type(legacy)}")
            call = ToolCall(self._new_id(), _function_name(legacy, at), _arguments_text(legacy, at))
            self.legacy_calls[call.name] = call.id
            self.call_ids.add(call.id)
            return (call,)
        if not isinstance(raw, list) or not raw:
            raise FormatError("invalid_tool_call", f"{where}.tool_calls must be a non-empty array of tool calls")
        calls: list[ToolCall] = []
        for j, c in enumerate(raw):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(c, dict):
                raise FormatError("invalid_tool_call", f"{at} must be an object, got {_json_type(c)}")
            if c.get("type", "function") != "function":
                raise FormatError("invalid_tool_call", f"{at}.type must be 'function', got {c.get('type')!r}")
            call_id = c.get("id")
            if call_id is not None and (not isinstance(call_id, str) or not call_id):
                raise FormatError("invalid_tool_call", f"{at}.id must be a non-empty string")
            fn = c.get("function")
            if fn is None:
                raise FormatError("missing_function_name", f"{at} has no 'function' (with 'name' and 'arguments')")
            if not isinstance(fn, dict):
                raise FormatError("invalid_tool_call", f"{at}.function must be an object, got {_json_type(fn)}")
            name = _function_name(fn, f"{at}.function")
            calls.append(ToolCall(call_id or self._new_id(), name, _arguments_text(fn, f"{at}.function")))
        self.call_ids.update(c.id for c in calls)
        return tuple(calls)

    def _answered_call(self, m: dict[str, Any], role: str, name: str | None, where: str) -> str | None:
        """The id of the call a tool (or legacy function) message answers; None for others."""
        call_id = m.get("tool_call_id")
        if role == "function":
            if name is None or name not in self.legacy_calls:
                raise FormatError(
                    "unknown_tool_call_id",
                    f"{where}: a 'function' message needs the 'name' of an earlier function_call",
                )
            return self.legacy_calls[name]
        if role != "tool":
            if call_id is not None:
                raise FormatError("invalid_tool_call", f"{where}: 'tool_call_id' is only allowed on tool messages")
            return None
        if not isinstance(call_id, str) or call_id not in self.call_ids:
            shown = "no 'tool_call_id'" if call_id is None else f"tool_call_id {call_id!r}"
            raise FormatError(
                "unknown_tool_call_id",
                f"{where} has {shown}, which matches no earlier assistant tool call of this line",
            )
        return call_id

    def _new_id(self) -> str:
        """An id for a call given without one (never one the line already uses)."""
        while True:
            self._n_new_ids += 1
            candidate = f"call_{self._n_new_ids}"
            if candidate not in self.call_ids:
                return candidate


def _tools(obj: dict[str, Any], where: str = "") -> tuple[tuple[dict[str, Any], ...], bool | None]:
    """A line's tool definitions (legacy ``functions`` converted) and ``parallel_tool_calls``."""
    tools, functions = obj.get("tools"), obj.get("functions")
    if tools is not None and functions is not None:
        raise FormatError("invalid_tools", f"give '{where}tools' or the legacy '{where}functions', not both")
    key = "functions" if functions is not None else "tools"
    raw = functions if functions is not None else tools
    out: list[dict[str, Any]] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise FormatError("invalid_tools", f"'{where}{key}' must be an array, got {_json_type(raw)}")
        for j, t in enumerate(raw):
            at = f"{where}{key}[{j}]"
            if not isinstance(t, dict):
                raise FormatError("invalid_tools", f"{at} must be an object, got {_json_type(t)}")
            if key == "functions":
                t = {"type": "function", "function": t}
            elif t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise FormatError("invalid_tools", f"{at} must be {{\"type\": \"function\", \"function\": {{...}}}}")
            fn = t["function"]
            if not isinstance(fn.get("name"), str) or not fn["name"].strip():
                raise FormatError("invalid_tools", f"{at}: the function needs a non-empty string 'name'")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise FormatError("invalid_tools", f"{at}: the function's 'parameters' must be a JSON schema object")
            out.append(t)
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FormatError(
            "invalid_type", f"'{where}parallel_tool_calls' must be true or false, got {_json_type(parallel)}"
        )
    return tuple(out), parallel


def _require_trained_turn(messages: tuple[Message, ...]) -> None:
    if not any(m.role == "assistant" and m.weight == 1 for m in messages):
        raise FormatError(
            "no_assistant_message", "needs at least one assistant message with weight 1 to train on"
        )


def _parse_chat(obj: dict[str, Any]) -> Example:
    messages = _LineMessages().parse_list(obj["messages"], "messages")
    _require_trained_turn(messages)
    tools, parallel = _tools(obj)
    return Example(messages=messages, tools=tools, parallel_tool_calls=parallel)


def _parse_sharegpt(obj: dict[str, Any]) -> Example:
    raw = obj["conversations"]
    if not isinstance(raw, list) or not raw:
        raise FormatError("invalid_messages", "'conversations' must be a non-empty array of turns")
    messages: list[Message] = []
    for i, turn in enumerate(raw):
        where = f"conversations[{i}]"
        speaker = _tag_of(turn, "from", where, "invalid_messages")
        if speaker not in SHAREGPT_ROLES:
            raise FormatError(
                "unrecognized_role", f"{where}.from '{speaker}' is not one of {', '.join(SHAREGPT_ROLES)}"
            )
        if turn.get("value") is None:
            raise FormatError("missing_content", f"{where} has no 'value'")
        value = turn["value"]
        if not isinstance(value, str):
            raise FormatError("invalid_type", f"{where}.value must be a string, got {_json_type(value)}")
        if not value.strip():
            raise FormatError("empty_content", f"{where}.value is empty")
        messages.append(Message(SHAREGPT_ROLES[speaker], value))
    _require_trained_turn(tuple(messages))
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


def _parse_preference(obj: dict[str, Any]) -> PreferenceExample:
    prompt_obj = obj.get("input")
    if prompt_obj is None:
        raise FormatError("missing_field", "missing the 'input' object (with the prompt's 'messages')")
    if not isinstance(prompt_obj, dict):
        raise FormatError("invalid_type", f"'input' must be an object, got {_json_type(prompt_obj)}")
    if "messages" not in prompt_obj:
        raise FormatError("missing_messages", "'input' has no 'messages' list")
    line = _LineMessages()
    prompt = line.parse_list(prompt_obj["messages"], "input.messages")
    tools, _ = _tools(prompt_obj, "input.")
    # Each answer may answer the prompt's calls but not see the other answer's.
    chosen = _preference_output(obj, "preferred_output", line)
    rejected = _preference_output(obj, "non_preferred_output", line)
    return PreferenceExample(prompt=prompt, chosen=chosen, rejected=rejected, tools=tools)


def _preference_output(obj: dict[str, Any], key: str, line: _LineMessages) -> Message:
    raw = obj.get(key)
    if raw is None:
        raise FormatError("missing_field", f"missing '{key}' (a list of one assistant message)")
    if not isinstance(raw, list) or len(raw) != 1:
        shown = f"{len(raw)} messages" if isinstance(raw, list) else _json_type(raw)
        raise FormatError("invalid_preference_output",
                          f"'{key}' must be a list of exactly one assistant message, got {shown}")
    if isinstance(raw[0], dict) and "weight" in raw[0]:
        raise FormatError("invalid_weight", f"{key}[0]: 'weight' is not used on preference outputs")
    fork = _LineMessages()
    fork.call_ids, fork.legacy_calls = set(line.call_ids), dict(line.legacy_calls)
    message = fork.parse(raw[0], f"{key}[0]")
    if message.role != "assistant":
        raise FormatError("invalid_preference_output", f"{key}[0].role must be 'assistant', got '{message.role}'")
    return message


def _parse_reinforcement(obj: dict[str, Any]) -> ReinforcementExample:
    messages = _LineMessages().parse_list(obj["messages"], "messages")
    if messages[-1].role != "user":
        raise FormatError(
            "prompt_not_user_last",
            f"messages must end in a user turn (the model samples the answer), not a {messages[-1].role} turn",
        )
    tools, parallel = _tools(obj)
    return ReinforcementExample(prompt=messages, item=obj, tools=tools, parallel_tool_calls=parallel)


_PARSERS: dict[str, Any] = {
    "chat": _parse_chat,
    "sharegpt": _parse_sharegpt,
    "prompt_completion": _parse_prompt_completion,
    "alpaca": _parse_alpaca,
    "preference": _parse_preference,
    "reinforcement": _parse_reinforcement,
}


def split_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes, int]]:
    """The lines of a file read in ``chunks``: (1-based number, the line without its end,
    its length in bytes), holding one line at a time.

    A line longer than ``MAX_LINE_BYTES`` keeps only its first ``MAX_LINE_BYTES + 1``
    bytes (its length is still counted in full): it is refused anyway, and a file that is
    one huge line must not be held whole. A UTF-8 byte order mark before the first line
    is dropped.
    """
    number, parts, kept, length = 1, [], 0, 0
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            length += len(piece)
            if kept <= MAX_LINE_BYTES:
                piece = piece[: MAX_LINE_BYTES + 1 - kept]
                parts.append(piece)
                kept += len(piece)
            if end < 0:
                break
            yield _line(number, parts, length)
            number, parts, kept, length = number + 1, [], 0, 0
            start = end + 1
    yield _line(number, parts, length)


def _line(number: int, parts: list[bytes], length: int) -> tuple[int, bytes, int]:
    raw = b"".join(parts)
    if number == 1 and raw.startswith(_BOM):
        raw, length = raw[len(_BOM):], length - len(_BOM)
    if raw.endswith(b"\r"):
        return number, raw[:-1], length - 1
    return number, raw, length


_BOM = b"\xef\xbb\xbf"


def _decode_line(number: int, raw: bytes, length: int | None = None) -> Any:
    """Bytes of one non-blank line -> parsed JSON; raises FormatError with the line number.

    ``length``: the line's full length when ``raw`` is only its start (``split_lines``)."""
    length = len(raw) if length is None else length
    if length > MAX_LINE_BYTES:
        raise FormatError(
            "line_too_long", f"line is {length} bytes, the limit is {MAX_LINE_BYTES}", number
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


def _message_chars(m: Message) -> int:
    return len(m.content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)


def _content_chars(example: AnyExample) -> int:
    """Characters the token estimate counts (see the module docstring)."""
    tools = len(json.dumps(list(example.tools), ensure_ascii=False)) if example.tools else 0
    if isinstance(example, PreferenceExample):
        turns = (*example.prompt, example.chosen, example.rejected)
    elif isinstance(example, ReinforcementExample):
        turns = example.prompt
    else:
        turns = example.messages
    return tools + sum(_message_chars(m) for m in turns)


def validate_jsonl(data: bytes | Iterable[bytes], *, max_errors: int = 50,
                   min_examples: int = 1) -> ValidationReport:
    """Validate a whole JSONL training file, one line at a time.

    Args:
        data: the file's bytes, or its bytes in chunks (memory then stays flat whatever
            the file's size: one chunk and one line at a time).
        max_errors: keep at most this many problems in ``errors`` (all are counted).
        min_examples: fewer valid examples than this is a ``too_few_examples`` problem.

    Returns:
        A report; ``report.ok`` is True iff the file can be trained on as is.
    """
    report = ValidationReport()
    chars = 0
    saw_line = False
    item_keys: set[str] | None = None

    def problem(line: int | None, code: str, message: str) -> None:
        report.n_errors += 1
        if len(report.errors) < max_errors:
            report.errors.append(FileProblem(line, code, message))

    for number, raw, length in split_lines((data,) if isinstance(data, bytes) else data):
        if not raw.strip():
            continue
        saw_line = True
        try:
            obj = _decode_line(number, raw, length)
            if not isinstance(obj, dict):
                raise FormatError("not_an_object", f"expected a JSON object, got {_json_type(obj)}")
            if report.format is None:
                found = detect_format(obj)
                if found is None:
                    raise FormatError(
                        "unknown_format",
                        "not a chat or reinforcement ('messages'), ShareGPT ('conversations'), "
                        "preference ('input'/'preferred_output'/'non_preferred_output'), "
                        "prompt/completion or alpaca ('instruction'/'output') example",
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
        if isinstance(example, ReinforcementExample):
            keys = set(example.item)
            item_keys = keys if item_keys is None else item_keys & keys
        report.token_stats.add(number, *row_token_bound(example))

    if not saw_line:
        problem(None, "empty_file", "the file has no examples")
    elif report.n_examples < min_examples:
        problem(
            None,
            "too_few_examples",
            f"{report.n_examples} valid example(s); at least {min_examples} required",
        )
    report.n_tokens_estimate = math.ceil(chars / 4)
    if item_keys is not None:
        report.item_keys = tuple(sorted(item_keys))
    return report


def read_examples(
    path_or_lines: str | Path | Iterable[str | bytes], fmt: Format | None = None
) -> Iterator[Example]:
    """Yield the supervised examples of a JSONL file (a path, or an iterable of lines).

    Args:
        path_or_lines: a file path, or lines as ``str``/``bytes``.
        fmt: the file's format (one of :data:`SUPERVISED_FORMATS`); None = detect it from
            the first non-blank line.

    Raises:
        FormatError: on the first invalid line (validate files first; the service does).
        ValueError: ``fmt`` is not a supervised format, or the file is preference data
            (read it with :func:`read_preference_examples`) or reinforcement prompts
            (:func:`read_reinforcement_examples`).
    """
    if fmt is not None and fmt not in SUPERVISED_FORMATS:
        raise ValueError(f"read_examples reads one of {SUPERVISED_FORMATS}, not {fmt!r}")
    for found, example in _read(path_or_lines, fmt):
        if found == "preference":
            raise ValueError("this is a preference file; read it with read_preference_examples")
        if found == "reinforcement":
            raise ValueError("this is a reinforcement file; read it with read_reinforcement_examples")
        yield example  # type: ignore[misc]


def read_preference_examples(path_or_lines: str | Path | Iterable[str | bytes]) -> Iterator[PreferenceExample]:
    """Yield the :class:`PreferenceExample` lines of a preference (DPO) JSONL file.

    Raises:
        FormatError: on the first invalid line, including a line of another format.
    """
    for _, example in _read(path_or_lines, "preference"):
        yield example  # type: ignore[misc]


def read_reinforcement_examples(
    path_or_lines: str | Path | Iterable[str | bytes],
) -> Iterator[ReinforcementExample]:
    """Yield the :class:`ReinforcementExample` lines of a reinforcement fine-tuning JSONL file.

    Raises:
        FormatError: on the first invalid line, including a line of another format.
    """
    for _, example in _read(path_or_lines, "reinforcement"):
        yield example  # type: ignore[misc]


def _read(
    path_or_lines: str | Path | Iterable[str | bytes], fmt: Format | None
) -> Iterator[tuple[Format, AnyExample]]:
    if isinstance(path_or_lines, (str, Path)):
        with open(path_or_lines, "rb") as f:
            yield from _read_lines(enumerate(f, start=1), fmt)
    else:
        yield from _read_lines(enumerate(path_or_lines, start=1), fmt)


def _read_lines(
    numbered: Iterable[tuple[int, str | bytes]], fmt: Format | None
) -> Iterator[tuple[Format, AnyExample]]:
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
            yield fmt, parse_example(obj, fmt)
        except FormatError as err:
            raise FormatError(err.code, err.message, number) from None
