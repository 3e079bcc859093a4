"""Preference pairs for DPO: tokenized (chosen, rejected) answers, batched pair-wise.

A DPO micro-batch holds BOTH answers of the same examples in one :class:`Batch`: rows
``0..k-1`` are the chosen answers of ``k`` pairs and rows ``k..2k-1`` their rejected
answers, in the same order (TRL's layout, "chosen first"). Both trainers run one policy
forward over the whole micro-batch and one reference forward (the same base, adapter
disabled) and read each row's summed completion log-prob; labels mark the answer tokens
only (``IGNORE_INDEX`` elsewhere), as for supervised data.

:class:`PreferenceData` is a :class:`~trainers.common.data.TrainingData` whose rows are
pairs: ``micro_batch_size`` counts pairs (a micro-batch has ``2 x micro_batch_size``
sequences), the epoch order shuffles pairs with the same seeded rule, pairs are never
packed, and the same :class:`~trainers.common.data.DataCursor` (epoch, pair position)
resumes a run exactly where the uninterrupted one would be.

The framework-free part of the loss bookkeeping lives here too: the reward metrics
(TRL's names, ``rewards/chosen`` etc.) from per-step sums that either trainer reduces
over its ranks or devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainers.common.data import (
    IGNORE_INDEX,
    Batch,
    DataCursor,
    PreferenceDataset,
    TokenizedDataset,
    TrainingData,
    epoch_order,
)
from trainers.common.job_data import JobData, load_job_data
from trainers.errors import UserError

REWARD_NAMES = ("chosen", "rejected", "accuracy", "margin")
REWARD_KEYS = tuple(f"rewards/{n}" for n in REWARD_NAMES)
VALID_REWARD_KEYS = tuple(f"valid_rewards/{n}" for n in REWARD_NAMES)
_START = DataCursor()


class PreferenceData(TrainingData):
    """Pairs in a deterministic per-epoch order, as micro-batches of ``2 x micro_batch_size``
    rows (chosen rows first). Arguments as :class:`TrainingData`; there is no packing."""

    def __init__(
        self,
        dataset: PreferenceDataset,
        *,
        max_seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
        pad_id: int = 0,
        pad_to: int | None = None,
    ) -> None:
        if not dataset.pairs:
            raise ValueError("the dataset has no trainable preference pairs")
        # Example 2p is pair p's chosen answer, 2p + 1 its rejected one.
        flat = [ex for pair in dataset.pairs for ex in pair]
        super().__init__(
            TokenizedDataset(flat, n_truncated=dataset.n_truncated, n_dropped=dataset.n_dropped),
            max_seq_len=max_seq_len, micro_batch_size=micro_batch_size, seed=seed, shuffle=shuffle,
            packing=False, pad_id=pad_id, pad_to=pad_to,
        )
        self.preference = dataset

    @property
    def n_pairs(self) -> int:
        return len(self.preference.pairs)

    def rows(self, epoch: int) -> list[list[int]]:
        """Pair indices of ``epoch`` in reading order (one pair per "row" of the cursor)."""
        if epoch not in self._rows_cache:
            order = epoch_order(self.n_pairs, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._rows_cache = {epoch: [[int(p)] for p in order]}
        return self._rows_cache[epoch]

    def collate(self, rows: Sequence[Sequence[int]], *, cursor_after: DataCursor = _START) -> Batch:
        """The batch of the pairs ``rows``: their chosen sequences, then their rejected ones."""
        pairs = [p for row in rows for p in row]
        sequences = [[2 * p] for p in pairs] + [[2 * p + 1] for p in pairs]
        return super().collate(sequences, cursor_after=cursor_after)


def pair_halves(batch: Batch) -> tuple[Batch, Batch]:
    """The chosen and the rejected half of a preference micro-batch."""
    k = batch.input_ids.shape[0] // 2

    def rows(sl: slice) -> Batch:
        return replace(batch, input_ids=batch.input_ids[sl], labels=batch.labels[sl],
                       position_ids=batch.position_ids[sl], segment_ids=batch.segment_ids[sl],
                       attention_mask=batch.attention_mask[sl])

    return rows(slice(0, k)), rows(slice(k, 2 * k))


def pad_pairs(batch: Batch, pairs: int, pad_id: int) -> Batch:
    """``batch`` with each half padded to ``pairs`` rows (fixed shapes for a compiled step).

    The padding rows are all-padding pairs: no label, no attention, so a trainer counts
    no pair for them (a pair counts iff its chosen row has a trained token).
    """
    k, length = batch.input_ids.shape[0] // 2, batch.input_ids.shape[1]
    if k > pairs:
        raise ValueError(f"a micro-batch of {k} pairs cannot be padded to {pairs}")
    extra = pairs - k

    def pad(x: np.ndarray, fill: np.ndarray) -> np.ndarray:
        return np.concatenate([x[:k], fill, x[k:], fill])

    zeros = np.zeros((extra, length), dtype=np.int64)
    return replace(
        batch,
        input_ids=pad(batch.input_ids, np.full((extra, length), pad_id, dtype=np.int64)),
        labels=pad(batch.labels, np.full((extra, length), IGNORE_INDEX, dtype=np.int64)),
        position_ids=pad(batch.position_ids, np.broadcast_to(np.arange(length), (extra, length)).astype(np.int64)),
        segment_ids=pad(batch.segment_ids, zeros),
        attention_mask=pad(batch.attention_mask, zeros),
    )


@dataclass(frozen=True)
class RewardSums:
    """Per-pair quantities of a DPO step (or eval pass) summed over its pairs.

    ``chosen`` / ``rejected`` are the implicit rewards ``beta * (log pi - log ref)`` of the
    answers, ``correct`` the pairs whose chosen reward is strictly the larger (TRL's
    accuracy), ``loss`` the summed per-pair DPO loss.
    """

    pairs: float = 0.0
    loss: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0
    correct: float = 0.0

    def as_list(self) -> list[float]:
        return [self.pairs, self.loss, self.chosen, self.rejected, self.correct]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> RewardSums:
        return cls(*(float(v) for v in values))

    def __add__(self, other: RewardSums) -> RewardSums:
        return RewardSums.from_list(np.add(self.as_list(), other.as_list()))

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """``{prefix}rewards/{chosen,rejected,accuracy,margin}``: means over the pairs."""
        n = max(self.pairs, 1.0)
        return {
            f"{prefix}rewards/chosen": self.chosen / n,
            f"{prefix}rewards/rejected": self.rejected / n,
            f"{prefix}rewards/accuracy": self.correct / n,
            f"{prefix}rewards/margin": (self.chosen - self.rejected) / n,
        }


@dataclass
class PreferenceJobData(JobData):
    """A DPO job's train (and validation) :class:`PreferenceData`; ``stats`` counts pairs."""

    train: PreferenceData
    validation: PreferenceData | None

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "train_examples": self.train.n_pairs}


def tokenize_preference_file(path: str | Path, tokenizer: Any, max_seq_len: int) -> PreferenceDataset:
    """Read and tokenize a preference JSONL file (UserError ``invalid_dataset`` on a bad
    line, a chat template that cannot be split into prompt and answer, or no pair left)."""
    from trainers.common.data import tokenize_preference_dataset
    from trainers.common.formats import FormatError, read_preference_examples

    name = Path(path).name
    try:
        dataset = tokenize_preference_dataset(tokenizer, read_preference_examples(path), max_seq_len)
    except (FormatError, ValueError) as err:
        raise UserError(f"{name}: {err}", code="invalid_dataset") from err
    if not dataset.pairs:
        raise UserError(
            f"{name}: no preference pair has a trained token left in both answers within "
            f"max_seq_len={max_seq_len}",
            code="invalid_dataset",
        )
    return dataset


def load_preference_data(spec: Any, tokenizer: Any, *, pad_to: int | None = None) -> PreferenceJobData:
    """The spec's preference files as resumable :class:`PreferenceData` (validation unshuffled).

    Raises:
        UserError: ``invalid_spec`` with ``data.packing`` set; ``invalid_dataset`` for a bad file.
    """
    d = spec.data
    if d.packing:
        raise UserError(
            "data.packing does not apply to DPO: the chosen and rejected answers of a pair are two "
            "rows of one micro-batch and are never packed; set packing to false",
            code="invalid_spec",
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def data(path: str, shuffle: bool) -> PreferenceData:
        return PreferenceData(
            tokenize_preference_file(path, tokenizer, d.max_seq_len), max_seq_len=d.max_seq_len,
            micro_batch_size=spec.hyperparameters.micro_batch_size, seed=spec.seed, shuffle=shuffle,
            pad_id=pad_id, pad_to=pad_to,
        )

    return PreferenceJobData(
        train=data(d.train_file, d.shuffle),
        validation=data(d.validation_file, False) if d.validation_file else None,
    )


def load_training_data(spec: Any, tokenizer: Any, *, pad_to: int | None = None) -> JobData | PreferenceJobData:
    """What the spec's method trains on: preference pairs for DPO
    (:func:`load_preference_data`), examples otherwise (``job_data.load_job_data``).

    Raises:
        UserError: ``method_unsupported`` for a reinforcement spec: its prompts are read by
            ``trainers.common.reinforcement.load_reinforcement_data`` for the sampling loop
            (both recipes do); reading them as supervised examples would train something
            else than was asked.
    """
    if spec.method.type == "reinforcement":
        raise UserError(
            "method.type 'reinforcement' trains on completions sampled from its prompts, not on the file as "
            "supervised examples; the job did not train",
            code="method_unsupported",
        )
    load = load_preference_data if spec.method.type == "dpo" else load_job_data
    return load(spec, tokenizer, pad_to=pad_to)
