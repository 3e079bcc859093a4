"""Tokenization, completion-only labels, packing, shuffling and batching (numpy only).

Both trainers feed on the :class:`Batch` this module produces and convert the arrays to
their framework; nothing here imports torch or jax. The tokenizer is any Hugging Face
tokenizer (``transformers.AutoTokenizer``), which both trainer images ship.

Rendering. An :class:`~trainers.common.formats.Example` is rendered with the tokenizer's
own ``chat_template`` when it has one, otherwise with :data:`FALLBACK_CHAT_TEMPLATE`
(a Llama-3-like layout written with the tokenizer's bos/eos tokens and plain-text role
headers: ``<bos>### user\\n{content}\\n### assistant\\n{content}<eos>\\n``).

Labels (completion-only loss). ``labels`` are aligned with ``input_ids`` (Hugging Face
convention: the loss shifts them, so ``labels[t]`` is predicted from tokens ``< t``).
A token is trained on iff it belongs to an assistant turn with ``weight`` 1: the
assistant's content plus the template's end-of-turn text (e.g. ``<|eot_id|>``), so the
model learns to stop. Everything else (bos, system/user turns, role headers, ``weight: 0``
assistant turns, padding) is ``IGNORE_INDEX`` (-100). The assistant span of turn ``i`` is
found from renders of prefixes: it starts where ``render(messages[:i],
add_generation_prompt=True)`` ends and ends where ``render(messages[:i+1])`` ends. For a
template where those renders are not prefixes of the full text, the span falls back to
the first occurrence of the content after the previous turn (without the end-of-turn).

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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np

from trainers.common.formats import Example

IGNORE_INDEX = -100

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)


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


def _render(tokenizer: Any, template: str, messages: Sequence[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=gen
    )


def _assistant_char_spans(tokenizer: Any, template: str, example: Example) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of trained assistant turns."""
    msgs = [{"role": m.role, "content": m.content} for m in example.messages]
    full = _render(tokenizer, template, msgs, gen=False)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for i, m in enumerate(example.messages):
        if m.role != "assistant":
            continue
        upto = _render(tokenizer, template, msgs[: i + 1], gen=False)
        head: str | None = None
        if i:  # an empty conversation cannot be rendered
            try:
                head = _render(tokenizer, template, msgs[:i], gen=True)
            except (jinja2.TemplateError, ValueError, IndexError):  # a template may refuse a prefix
                head = None
        if head is not None and full.startswith(upto) and upto.startswith(head) and len(head) >= search_from:
            start, end = len(head), len(upto)
        else:
            start = full.find(m.content, search_from)
            end = start + len(m.content)
            if full.startswith(upto) and len(upto) >= end:
                end = len(upto)  # keep the template's end-of-turn text in the span
        if start < 0:
            raise ValueError(f"chat template dropped the content of assistant turn {i}")
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
    """Tokenize every example; truncate to ``max_seq_len`` (counted); drop label-less ones."""
    template = chat_template_of(tokenizer)
    out = TokenizedDataset(examples=[])
    for ex in examples:
        tok = tokenize_example(tokenizer, ex, template=template)
        if len(tok) > max_seq_len:
            out.n_truncated += 1
            tok = TokenizedExample(tok.input_ids[:max_seq_len], tok.labels[:max_seq_len])
        # The first label is never predicted (causal shift), so it does not count.
        if all(x == IGNORE_INDEX for x in tok.labels[1:]):
            out.n_dropped += 1
            continue
        out.examples.append(tok)
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
