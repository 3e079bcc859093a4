"""Tokenization, completion-only labels, packing, shuffling and batching (numpy only).

Both trainers feed on the :class:`Batch` this module produces and convert the arrays to
their framework; nothing here imports torch or jax. The tokenizer is any Hugging Face
tokenizer (``transformers.AutoTokenizer``), which both trainer images ship.

Rendering. An :class:`~trainers.common.formats.Example` is rendered with the tokenizer's
own ``chat_template`` when it has one, otherwise with :data:`FALLBACK_CHAT_TEMPLATE`
(a Llama-3-like layout written with the tokenizer's bos/eos tokens and plain-text role
headers: ``<bos>### user\\n{content}\\n### assistant\\n{content}<eos>\\n``), as
``apply_chat_template(messages, tools=example.tools)``. Messages are passed in the
Hugging Face dict form (:func:`chat_template_messages`): an assistant's tool calls as
``{"type": "function", "function": {"name", "arguments"}}`` with the arguments parsed to
a dict (what Llama 3.1's template and most others expect), a tool result with its
``tool_call_id``.

Labels (completion-only loss). ``labels`` are aligned with ``input_ids`` (Hugging Face
convention: the loss shifts them, so ``labels[t]`` is predicted from tokens ``< t``).
A token is trained on iff it belongs to an assistant turn with ``weight`` 1: the
assistant's content and its tool calls as the template renders them, plus the template's
end-of-turn text (e.g. ``<|eot_id|>``), so the model learns to stop. Tool results are
never trained on (they are the tool's words, not the model's). Everything else (bos,
system/user turns, role headers, ``weight: 0``
assistant turns, padding) is ``IGNORE_INDEX`` (-100). The assistant span of turn ``i`` is
found from renders of prefixes: it starts where ``render(messages[:i],
add_generation_prompt=True)`` ends and ends where ``render(messages[:i+1])`` ends. For a
template where those renders are not prefixes of the full text, the span falls back to
the first occurrence of the content after the previous turn (without the end-of-turn).

Preference pairs (DPO). :func:`tokenize_preference` renders the prompt with the
generation prompt (``render(prompt, add_generation_prompt=True)``) and each answer as
the text the template adds after it (``render(prompt + [answer])`` minus that prefix,
end-of-turn included); the prompt and each answer are tokenized separately, so both
sequences of a pair share the very same prompt ids. Labels are the answer tokens only
(completion-only log-probs); the prompt is ``IGNORE_INDEX``. Truncation of a pair whose
prompt + longer answer exceeds ``max_seq_len``: the prompt is cut from the LEFT (its
latest turns and the generation prompt stay) to ``max(max_seq_len - longer answer,
min(prompt length, max_seq_len // 2))`` tokens, then the answers are cut at the end to
what is left. So an answer is kept whole unless it needs more than half the window
and the prompt is longer than the other half.

Truncation. Sequences longer than ``max_seq_len`` are cut at the end and counted
(``TokenizedDataset.n_truncated``); an example left with no trained token is dropped and
counted (``n_dropped``): it would only add padding.

Packing. Greedy first-fit in the epoch's shuffled order: a row takes examples until the
next one does not fit; examples never cross a row boundary and are never split.
``position_ids`` restart at 0 for each example and ``segment_ids`` number the examples
of a row 1, 2, ... (0 = padding), so a trainer can build a block-diagonal causal mask:
token ``q`` may attend to ``k`` iff ``segment[q] == segment[k] != 0 and k <= q``.
Support: the JAX trainer builds that mask from ``segment_ids``; the torch recipe passes
it to transformers as a 4D mask (``trainers.fsdp_qlora.train_step.model_inputs``). The
first token of every example is also labelled -100 so no loss crosses a boundary.

Order and resume. Epoch ``e`` visits rows in ``numpy.random.default_rng([seed, e])``
order (identity when ``shuffle`` is False). A :class:`DataCursor` ``(epoch, position)``
names the next row to read; it is saved in checkpoints, and
:meth:`TrainingData.micro_batches` started from a saved cursor yields exactly the
batches the uninterrupted run would have yielded next.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np

from trainers.common.formats import Example, Message, PreferenceExample

IGNORE_INDEX = -100

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '### tools\n' }}{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The model's chat template cannot render an example (a valid file line): e.g. a
    template that takes one tool call per message, or refuses a role order."""


def _rendering(n: int, tokenize: Any, *args: Any, **kwargs: Any) -> Any:
    """``tokenize(*args, **kwargs)`` with a template's refusal named by example number."""
    try:
        return tokenize(*args, **kwargs)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError) as exc:  # what templates raise
        raise ChatTemplateError(f"example {n}: the model's chat template cannot render it: {exc}") from exc


@dataclass(frozen=True)
class TokenizedExample:
    """One example as token ids with aligned labels (``IGNORE_INDEX`` = not trained)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_label_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


@dataclass
class TokenizedDataset:
    examples: list[TokenizedExample]
    n_truncated: int = 0
    n_dropped: int = 0

    @property
    def n_tokens(self) -> int:
        return sum(len(e) for e in self.examples)


@dataclass(frozen=True)
class DataCursor:
    """Where the next row comes from: ``position``-th row of epoch ``epoch``'s order."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataCursor:
        return cls(epoch=int(d["epoch"]), position=int(d["position"]))


@dataclass
class Batch:
    """A micro-batch of rows, padded to one length. All arrays are ``(rows, length)`` int64."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    attention_mask: np.ndarray
    cursor_after: DataCursor = field(default_factory=DataCursor)

    @property
    def n_label_tokens(self) -> int:
        """Tokens the loss counts after the causal shift (labels[:, 1:] != -100)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template, or :data:`FALLBACK_CHAT_TEMPLATE` if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else FALLBACK_CHAT_TEMPLATE


def chat_template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Canonical messages in the dict form ``apply_chat_template`` takes.

    Tool-call arguments are parsed from their JSON text to a dict (templates render them
    with ``tojson``); ``name`` and ``tool_call_id`` are passed only when set.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _render(
    tokenizer: Any, template: str, messages: Sequence[dict[str, Any]], gen: bool, tools: Sequence[dict[str, Any]] = ()
) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) or None, chat_template=template, tokenize=False, add_generation_prompt=gen
    )


def _require_tools_rendered(
    tokenizer: Any, template: str, msgs: list[dict[str, Any]], tools: Sequence[dict[str, Any]], gen: bool, text: str
) -> None:
    """A template without tool support renders ``tools`` as nothing: refuse to train so."""
    if tools and _render(tokenizer, template, msgs, gen) == text:
        raise ValueError("the chat template ignores the line's 'tools'; use a model whose template supports tools")


def _require_calls_rendered(text: str, message: Message, where: str) -> None:
    missing = [c.name for c in message.tool_calls if c.name not in text]
    if missing:
        raise ValueError(
            f"the chat template does not render the tool call(s) {', '.join(missing)} of {where}; "
            "use a model whose template supports tool calls"
        )


def _assistant_char_spans(tokenizer: Any, template: str, example: Example) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of trained assistant turns."""
    msgs = chat_template_messages(example.messages)
    tools = example.tools
    full = _render(tokenizer, template, msgs, False, tools)
    _require_tools_rendered(tokenizer, template, msgs, tools, False, full)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for i, m in enumerate(example.messages):
        if m.role != "assistant":
            continue
        upto = _render(tokenizer, template, msgs[: i + 1], False, tools)
        head: str | None = None
        if i:  # an empty conversation cannot be rendered
            try:
                head = _render(tokenizer, template, msgs[:i], True, tools)
            except (jinja2.TemplateError, ValueError, IndexError):  # a template may refuse a prefix
                head = None
        if head is not None and full.startswith(upto) and upto.startswith(head) and len(head) >= search_from:
            start, end = len(head), len(upto)
        else:
            if not m.content:  # a tool-call-only turn has no text of its own to look for
                raise ValueError(f"chat template: cannot locate the tool calls of assistant turn {i}")
            start = full.find(m.content, search_from)
            end = start + len(m.content)
            if full.startswith(upto) and len(upto) >= end:
                end = len(upto)  # keep the template's end-of-turn text in the span
        if start < 0:
            raise ValueError(f"chat template dropped the content of assistant turn {i}")
        _require_calls_rendered(full[start:end], m, f"assistant turn {i}")
        search_from = end
        if m.weight == 1:
            spans.append((start, end))
    return full, spans


def tokenize_example(tokenizer: Any, example: Example, *, template: str | None = None) -> TokenizedExample:
    """Render with the chat template and label the trained assistant tokens (not truncated)."""
    template = template or chat_template_of(tokenizer)
    text, spans = _assistant_char_spans(tokenizer, template, example)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    for t, (cs, ce) in enumerate(enc["offset_mapping"]):
        # A token is trained if it lies inside a span (byte tokens of one character share
        # the character's offsets, so both halves of a multi-byte character are included).
        if ce > cs and any(s <= cs and ce <= e for s, e in spans):
            labels[t] = ids[t]
    return TokenizedExample(tuple(ids), tuple(labels))


def tokenize_dataset(tokenizer: Any, examples: Iterable[Example], max_seq_len: int) -> TokenizedDataset:
    """Tokenize every example; truncate to ``max_seq_len`` (counted); drop label-less ones.

    Raises:
        ChatTemplateError: the template refuses an example (named by its 1-based number).
    """
    template = chat_template_of(tokenizer)
    out = TokenizedDataset(examples=[])
    for n, ex in enumerate(examples, start=1):
        tok = _rendering(n, tokenize_example, tokenizer, ex, template=template)
        if len(tok) > max_seq_len:
            out.n_truncated += 1
            tok = TokenizedExample(tok.input_ids[:max_seq_len], tok.labels[:max_seq_len])
        # The first label is never predicted (causal shift), so it does not count.
        if all(x == IGNORE_INDEX for x in tok.labels[1:]):
            out.n_dropped += 1
            continue
        out.examples.append(tok)
    return out


@dataclass
class PreferenceDataset:
    """Tokenized preference pairs ``(chosen, rejected)``, each sharing its prompt ids."""

    pairs: list[tuple[TokenizedExample, TokenizedExample]]
    n_truncated: int = 0
    n_dropped: int = 0

    @property
    def n_tokens(self) -> int:
        return sum(len(c) + len(r) for c, r in self.pairs)


def truncate_preference(
    prompt: Sequence[int], answers: Sequence[Sequence[int]], max_seq_len: int
) -> tuple[list[int], list[list[int]]]:
    """Fit a prompt and its answers to ``max_seq_len`` (the rule: module docstring)."""
    longest = max(len(a) for a in answers)
    if len(prompt) + longest <= max_seq_len:
        return list(prompt), [list(a) for a in answers]
    keep = max(max_seq_len - longest, min(len(prompt), max_seq_len // 2))
    kept = list(prompt[len(prompt) - keep :]) if keep < len(prompt) else list(prompt)
    room = max_seq_len - len(kept)
    return kept, [list(a[:room]) for a in answers]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _preference_ids(tokenizer: Any, template: str, example: PreferenceExample) -> tuple[list[int], list[list[int]]]:
    """Untruncated prompt ids and the ids of (chosen, rejected)."""
    prompt = chat_template_messages(example.prompt)
    head = _render(tokenizer, template, prompt, True, example.tools)
    _require_tools_rendered(tokenizer, template, prompt, example.tools, True, head)
    answers: list[list[int]] = []
    for name, answer in (("the preferred answer", example.chosen), ("the rejected answer", example.rejected)):
        full = _render(tokenizer, template, prompt + chat_template_messages([answer]), False, example.tools)
        if not full.startswith(head) or len(full) == len(head):
            raise ValueError(
                "the chat template does not render prompt + answer as the prompt (with its generation "
                "prompt) followed by the answer; preference pairs cannot be split for this template"
            )
        _require_calls_rendered(full[len(head) :], answer, name)
        answers.append(_encode(tokenizer, full[len(head) :]))
    return _encode(tokenizer, head), answers


def _pair(prompt: list[int], answers: list[list[int]]) -> tuple[TokenizedExample, TokenizedExample]:
    chosen, rejected = (
        TokenizedExample(tuple(prompt + a), tuple([IGNORE_INDEX] * len(prompt) + a)) for a in answers
    )
    return chosen, rejected


def tokenize_preference(
    tokenizer: Any, example: PreferenceExample, *, template: str | None = None, max_seq_len: int
) -> tuple[TokenizedExample, TokenizedExample]:
    """Tokenize a preference example as ``(chosen, rejected)`` sequences of one prompt.

    Each sequence is the prompt's ids then the answer's; labels are the answer's ids and
    ``IGNORE_INDEX`` on the prompt. Both fit ``max_seq_len`` (the truncation rule: module
    docstring).

    Raises:
        ValueError: the chat template cannot be split into prompt and answer.
    """
    prompt, answers = _preference_ids(tokenizer, template or chat_template_of(tokenizer), example)
    return _pair(*truncate_preference(prompt, answers, max_seq_len))


def tokenize_preference_dataset(
    tokenizer: Any, examples: Iterable[PreferenceExample], max_seq_len: int
) -> PreferenceDataset:
    """Tokenize every pair; count the truncated ones; drop a pair with an answer left
    without a trained token (it would carry no preference signal).

    Raises:
        ChatTemplateError: the template refuses an example or cannot split it into prompt
            and answer (named by its 1-based number).
    """
    template = chat_template_of(tokenizer)
    out = PreferenceDataset(pairs=[])
    for n, ex in enumerate(examples, start=1):
        prompt, answers = _rendering(n, _preference_ids, tokenizer, template, ex)
        if len(prompt) + max(len(a) for a in answers) > max_seq_len:
            out.n_truncated += 1
        pair = _pair(*truncate_preference(prompt, answers, max_seq_len))
        if any(all(x == IGNORE_INDEX for x in t.labels[1:]) for t in pair):
            out.n_dropped += 1
            continue
        out.pairs.append(pair)
    return out


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Indices of ``n`` items in epoch ``epoch``'s order (deterministic in seed and epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def pack_greedy(lengths: Sequence[int], order: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Group item indices (visited in ``order``) into rows of total length <= max_seq_len."""
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = lengths[i]
        if current and used + n > max_seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(int(i))
        used += n
    if current:
        rows.append(current)
    return rows


class TrainingData:
    """Rows of a tokenized dataset in a deterministic per-epoch order, as padded batches.

    Args:
        dataset: the tokenized examples.
        max_seq_len: row length limit (examples are already truncated to it).
        micro_batch_size: rows per micro-batch.
        seed: shuffling seed.
        shuffle: shuffle rows each epoch.
        packing: pack several examples per row (see the module docstring).
        pad_id: token id used for padding ``input_ids``.
        pad_to: pad every batch to this length (fixed shapes for jit); None = longest row.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        *,
        max_seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
        packing: bool = False,
        pad_id: int = 0,
        pad_to: int | None = None,
    ) -> None:
        if not dataset.examples:
            raise ValueError("the dataset has no trainable examples")
        self.dataset = dataset
        self.max_seq_len = max_seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.packing = packing
        self.pad_id = pad_id
        self.pad_to = pad_to
        self._rows_cache: dict[int, list[list[int]]] = {}

    def rows(self, epoch: int) -> list[list[int]]:
        """Example indices of each row of ``epoch``, in reading order."""
        if epoch not in self._rows_cache:
            n = len(self.dataset.examples)
            order = epoch_order(n, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            if self.packing:
                lengths = [len(e) for e in self.dataset.examples]
                rows = pack_greedy(lengths, order, self.max_seq_len)
            else:
                rows = [[int(i)] for i in order]
            self._rows_cache = {epoch: rows}  # one epoch at a time is all a loop needs
        return self._rows_cache[epoch]

    def rows_per_epoch(self, epoch: int = 0) -> int:
        return len(self.rows(epoch))

    def micro_batches_per_epoch(self, epoch: int = 0) -> int:
        return -(-self.rows_per_epoch(epoch) // self.micro_batch_size)

    def micro_batches(self, start: DataCursor = DataCursor()) -> Iterator[Batch]:
        """Micro-batches from ``start`` on, forever (epoch after epoch).

        A micro-batch never spans two epochs (the last one of an epoch may be smaller);
        each batch carries ``cursor_after``, the cursor to save once it is consumed.
        """
        epoch, position = start.epoch, start.position
        while True:
            rows = self.rows(epoch)
            if position >= len(rows):
                epoch, position = epoch + 1, 0
                continue
            chunk = rows[position : position + self.micro_batch_size]
            position += len(chunk)
            after = DataCursor(epoch, position) if position < len(rows) else DataCursor(epoch + 1, 0)
            yield self.collate(chunk, cursor_after=after)
            epoch, position = after.epoch, after.position

    def collate(self, rows: Sequence[Sequence[int]], *, cursor_after: DataCursor = DataCursor()) -> Batch:
        """Build a padded :class:`Batch` from rows of example indices."""
        examples = self.dataset.examples
        lengths = [sum(len(examples[i]) for i in row) for row in rows]
        length = self.pad_to or max(lengths)
        if max(lengths) > length:
            raise ValueError(f"a row has {max(lengths)} tokens, more than pad_to={length}")
        shape = (len(rows), length)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros(shape, dtype=np.int64)
        segment_ids = np.zeros(shape, dtype=np.int64)
        for r, row in enumerate(rows):
            t = 0
            for seg, i in enumerate(row, start=1):
                ex = examples[i]
                n = len(ex)
                input_ids[r, t : t + n] = ex.input_ids
                labels[r, t : t + n] = ex.labels
                labels[r, t] = IGNORE_INDEX  # never predict across an example boundary
                position_ids[r, t : t + n] = np.arange(n)
                segment_ids[r, t : t + n] = seg
                t += n
            # Padding continues the positions so rotary embeddings stay in range and finite.
            next_pos = position_ids[r, t - 1] + 1 if t else 0
            position_ids[r, t:] = next_pos + np.arange(length - t)
        attention_mask = (segment_ids > 0).astype(np.int64)
        return Batch(input_ids, labels, position_ids, segment_ids, attention_mask, cursor_after)


def block_causal_mask(segment_ids: np.ndarray) -> np.ndarray:
    """Boolean ``(rows, 1, L, L)`` mask: True where query ``q`` may attend to key ``k``
    (same non-padding segment and ``k <= q``). Padding queries attend to themselves only,
    so no softmax row is empty (their outputs are never trained on)."""
    seg = segment_ids
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    length = seg.shape[1]
    causal = np.tril(np.ones((length, length), dtype=bool))
    mask = same & causal[None]
    eye = np.eye(length, dtype=bool)[None]
    mask = mask | (eye & (seg[:, :, None] == 0))
    return mask[:, None]
