"""Reinforcement fine-tuning's prompts and metrics, framework-free.

A reinforcement job trains on prompts, not on answers: each optimizer step reads
``batch_size`` prompts at the data cursor, the recipe samples ``samples_per_prompt``
completions of each from the current policy, grades them with the job's grader and trains
on them with GRPO's loss (``trainers.common.grpo``; the torch step is
``trainers/fsdp_qlora/grpo_step.py``).

:class:`PromptData` holds the tokenized prompts (the chat template with its generation
prompt, so the model's answer starts right after) and each line's grader ``item``, in a
deterministic per-epoch order (``trainers.common.data.epoch_order``, the supervised rule)
read through the same :class:`~trainers.common.data.DataCursor`, so a resumed run reads
the prompts the uninterrupted one would. A step may span two epochs; the cursor moves to
``(epoch + 1, 0)`` as soon as an epoch's last prompt is read, as the supervised loader does.

A prompt longer than ``max_seq_len - 1`` tokens leaves no room for an answer and is
dropped (counted in ``n_dropped``); the rest get ``min(max_completion_tokens,
max_seq_len - prompt tokens)`` new tokens at most.

The metric names a reinforcement run reports per step (:data:`REINFORCEMENT_KEYS`) and at
evaluation (:data:`VALID_REINFORCEMENT_KEYS`) live here, beside DPO's in
``trainers.common.preference``, for the common metric row (``trainers.common.loop``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.common.data import (
    ChatTemplateError,
    DataCursor,
    _render,
    _rendering,
    _require_tools_rendered,
    chat_template_messages,
    chat_template_of,
    epoch_order,
)
from trainers.common.formats import FormatError, ReinforcementExample, read_reinforcement_examples
from trainers.errors import UserError

REINFORCEMENT_KEYS = ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length")
"""A step's metrics: the mean and std of its completions' rewards, the mean per-token KL to
the reference (None with ``kl_coef`` 0), the fraction of completion tokens whose ratio was
clipped, and the mean completion length in tokens."""
VALID_REINFORCEMENT_KEYS = ("valid_reward_mean",)
"""An evaluation's metric: the mean reward of the validation prompts' completions."""


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt: its ids (generation prompt included), its grader ``item`` and
    how many tokens its answer may have."""

    input_ids: tuple[int, ...]
    item: dict[str, Any]
    max_new_tokens: int


@dataclass
class PromptDataset:
    prompts: list[Prompt]
    n_dropped: int = 0
    n_truncated: int = 0  # prompts are never truncated (a cut prompt asks another question)

    @property
    def n_tokens(self) -> int:
        return sum(len(p.input_ids) for p in self.prompts)


def tokenize_prompt(tokenizer: Any, template: str, example: ReinforcementExample) -> list[int]:
    """The prompt's ids as the chat template renders it with the generation prompt."""
    messages = chat_template_messages(example.prompt)
    text = _render(tokenizer, template, messages, True, example.tools)
    _require_tools_rendered(tokenizer, template, messages, example.tools, True, text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_prompts(tokenizer: Any, examples: Iterable[ReinforcementExample], *, max_seq_len: int,
                     max_completion_tokens: int) -> PromptDataset:
    """Tokenize every prompt; drop those that leave no room for an answer (module doc)."""
    template = chat_template_of(tokenizer)
    out = PromptDataset(prompts=[])
    for n, example in enumerate(examples, start=1):
        ids = _rendering(n, tokenize_prompt, tokenizer, template, example)
        room = max_seq_len - len(ids)
        if room < 1:
            out.n_dropped += 1
            continue
        out.prompts.append(Prompt(tuple(ids), example.item, min(max_completion_tokens, room)))
    return out


class PromptData:
    """The prompts in a deterministic per-epoch order, read ``n`` at a time from a cursor.

    Args:
        dataset: the tokenized prompts.
        micro_batch_size: prompts per loss micro-batch (each with all its completions).
        seed: the shuffling seed; ``shuffle`` False keeps the file's order (validation).
    """

    def __init__(self, dataset: PromptDataset, *, micro_batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not dataset.prompts:
            raise ValueError("the dataset has no prompt to sample from")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._order: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.dataset.prompts)

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._order:
            self._order = {epoch: [int(i) for i in epoch_order(len(self), seed=self.seed, epoch=epoch,
                                                                   shuffle=self.shuffle)]}
        return self._order[epoch]

    def rows_per_epoch(self, epoch: int = 0) -> int:
        return len(self)

    def micro_batches_per_epoch(self, epoch: int = 0) -> int:
        """Micro-batches of prompts per epoch (``total_optimizer_steps`` counts steps from it)."""
        return -(-len(self) // self.micro_batch_size)

    def take(self, cursor: DataCursor, n: int) -> tuple[list[Prompt], DataCursor]:
        """The ``n`` prompts from ``cursor`` on (across epochs) and the cursor after them."""
        epoch, position = cursor.epoch, cursor.position
        out: list[Prompt] = []
        while len(out) < n:
            order = self.order(epoch)
            if position >= len(order):
                epoch, position = epoch + 1, 0
                continue
            out.append(self.dataset.prompts[order[position]])
            position += 1
        if position >= len(self.order(epoch)):
            epoch, position = epoch + 1, 0
        return out, DataCursor(epoch, position)


@dataclass
class ReinforcementJobData:
    """A reinforcement job's train (and validation) prompts."""

    train: PromptData
    validation: PromptData | None

    def stats(self) -> dict[str, int]:
        ds = self.train.dataset
        return {"train_examples": len(ds.prompts), "train_tokens": ds.n_tokens, "truncated_examples": 0,
                "dropped_examples": ds.n_dropped, "rows_per_epoch": len(ds.prompts)}


def load_prompt_file(path: str | Path, tokenizer: Any, *, max_seq_len: int,
                     max_completion_tokens: int) -> PromptDataset:
    """Read and tokenize a reinforcement JSONL file (UserError ``invalid_dataset`` on a bad
    line, a template that refuses a prompt, or no prompt that leaves room for an answer)."""
    name = Path(path).name
    try:
        dataset = tokenize_prompts(tokenizer, read_reinforcement_examples(path), max_seq_len=max_seq_len,
                                   max_completion_tokens=max_completion_tokens)
    except (FormatError, ChatTemplateError, ValueError) as err:
        raise UserError(f"{name}: {err}", code="invalid_dataset") from err
    if not dataset.prompts:
        raise UserError(f"{name}: no prompt leaves room for an answer within max_seq_len={max_seq_len}",
                        code="invalid_dataset")
    return dataset


def load_reinforcement_data(spec: Any, tokenizer: Any) -> ReinforcementJobData:
    """The spec's reinforcement files as :class:`PromptData` (validation in file order)."""
    d, rft = spec.data, spec.method.reinforcement
    if d.packing:
        raise UserError("data.packing does not apply to reinforcement fine-tuning: each prompt's completions are "
                        "sampled and trained as their own rows; set packing to false", code="invalid_spec")

    def data(path: str, shuffle: bool) -> PromptData:
        prompts = load_prompt_file(path, tokenizer, max_seq_len=d.max_seq_len,
                                   max_completion_tokens=rft.max_completion_tokens)
        return PromptData(prompts, micro_batch_size=spec.hyperparameters.micro_batch_size, seed=spec.seed,
                          shuffle=shuffle)

    return ReinforcementJobData(train=data(d.train_file, d.shuffle),
                                validation=data(d.validation_file, False) if d.validation_file else None)
