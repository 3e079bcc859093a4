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

Everything else a GRPO step does that no framework changes is here too, so both trainers
(``trainers/fsdp_qlora/grpo_step.py``, ``trainers/jax_lora/grpo.py``) run the same rules:
the job's settings with its grader parsed (:func:`grpo_objective`), the tokens that end
an answer (:func:`stop_token_ids`), the seed of a step's draws (:func:`sampling_seed`),
grading (:func:`grade_completions`), the group advantages (:func:`group_advantages`),
a step's metrics (:func:`step_metrics`) and the warning a step's grader errors raise
(:class:`GraderErrorWarnings`). Numpy only: the JAX trainer has no torch.

Besides its rewards, a step's grading yields a :class:`GradingSummary` (:data:`GRADING_KEYS`
of the metric row): the mean reward of each sub-grader of a ``multi`` grader
(``sub_rewards``; None for any other grader, whose only reward is ``reward_mean``) and how
many completions the grader could not score (``grader_errors``: a python grader that
raised or was stopped by the sandbox, a template naming what the line lacks, ...). Those
completions got reward 0, as OpenAI's graders give them; without the count a broken grader
would look like a policy that never earns anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

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
from trainers.common.graders import (
    GradeResult,
    GraderInvalid,
    GradingContext,
    grade_batch,
    parse_grader,
    sample_namespace,
)
from trainers.common.graders.models import MultiGrader, uses_model_grader
from trainers.errors import UserError

REINFORCEMENT_KEYS = ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length")
"""A step's metrics: the mean and std of its completions' rewards, the mean per-token KL to
the reference (None with ``kl_coef`` 0), the fraction of completion tokens whose ratio was
clipped, and the mean completion length in tokens."""
GRADING_KEYS = ("sub_rewards", "grader_errors")
"""What a step's grading adds to its row (:class:`GradingSummary`): ``sub_rewards``, a
``multi`` grader's sub-graders' mean rewards by name (None for other graders), and
``grader_errors``, the completions the grader could not score. Apart from
:data:`REINFORCEMENT_KEYS` because they are no single float: a checkpoint records only those."""
MAX_SUB_REWARDS = 16
"""The most sub-rewards a row carries (the first sub-graders in the grader's order): the
API refuses a report with more, so that no trainer can grow a metric row without bound."""
MAX_SUB_REWARD_NAME = 64
"""The longest sub-grader name a row carries; a sub-grader with a longer name is left out."""
ERROR_DETAIL_CHARS = 500
"""How much of a failing sample's error details a grader-error warning quotes."""
VALID_REINFORCEMENT_KEYS = ("valid_reward_mean",)
"""An evaluation's metric: the mean reward of the validation prompts' completions."""

ADVANTAGE_EPS = 1e-4
"""Added to a group's reward std: a group whose rewards are all equal gets advantage 0."""

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
"""End-of-turn tokens of common chat templates (Llama 3, ChatML/Qwen, Gemma, Phi): a sampled
answer stops at any of them that the tokenizer has, besides its EOS."""


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

    def evaluation_prompts(self, max_batches: int | None) -> list[Prompt]:
        """The prompts an evaluation reads: the first ``max_batches`` micro-batches of epoch
        0's order (all of them with None); a validation set keeps its file order."""
        n = len(self) if max_batches is None else min(len(self), max_batches * self.micro_batch_size)
        return [self.dataset.prompts[i] for i in self.order(0)[:n]]

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


@dataclass(frozen=True)
class GrpoObjective:
    """What a GRPO step needs besides the model: the spec's method settings, the parsed
    grader, the tokens that end an answer, the padding id and the tokenizer's decoder."""

    grader: Any
    samples_per_prompt: int
    temperature: float
    kl_coef: float
    clip_epsilon: float
    loss_type: str
    max_completion_tokens: int
    eval_samples: int
    stop_ids: frozenset[int]
    pad_id: int
    decode: Callable[[Sequence[int]], str]
    grading: GradingContext = field(default_factory=GradingContext)


def stop_token_ids(tokenizer: Any, model_dir: str) -> frozenset[int]:
    """The ids that end a sampled answer: the tokenizer's EOS, the end-of-turn tokens it
    has (:data:`END_OF_TURN_TOKENS`) and the model's ``generation_config`` EOS ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in END_OF_TURN_TOKENS if t in vocab)
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        eos = None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return frozenset(ids)


def grpo_objective(spec: Any, tokenizer: Any) -> GrpoObjective:
    """The GRPO settings of a reinforcement spec, with its grader parsed and checked.

    Raises:
        UserError: ``invalid_grader`` for a grader the parser refuses (the API checked it;
            a hand-written spec may not have been); ``grader_unavailable`` for a
            ``score_model`` grader, which needs a chat-completion endpoint the trainer has
            no access to (every reward would be 0).
    """
    rft = spec.method.reinforcement
    try:
        grader = parse_grader(rft.grader, param="method.reinforcement.grader")
    except GraderInvalid as exc:
        raise UserError(f"method.reinforcement.grader: {exc}", code="invalid_grader") from exc
    if uses_model_grader(rft.grader):
        raise UserError("score_model graders are not available during training (no model endpoint reaches the "
                        "trainer); use string_check, text_similarity or python graders", code="grader_unavailable")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return GrpoObjective(
        grader=grader, samples_per_prompt=rft.samples_per_prompt, temperature=rft.temperature,
        kl_coef=rft.kl_coef, clip_epsilon=rft.clip_epsilon, loss_type=rft.loss_type,
        max_completion_tokens=rft.max_completion_tokens, eval_samples=rft.eval_samples,
        stop_ids=stop_token_ids(tokenizer, spec.model.path), pad_id=pad_id,
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )


def sampling_seed(seed: int, step: int, *, stream: int = 0) -> int:
    """The seed of step ``step``'s draws (``stream`` 1: an evaluation's): a function of the
    job's seed and the step alone, so a resumed run samples what the uninterrupted one did
    without saving any generator state."""
    return ((seed * 1_000_003 + step) * 4_099 + stream) % (1 << 63)


def cut_at_stop(tokens: Sequence[int], stop_ids: frozenset[int]) -> list[int]:
    """A drawn row up to and including its first stop token (the whole row without one)."""
    end = next((i + 1 for i, x in enumerate(tokens) if x in stop_ids), len(tokens))
    return [int(x) for x in tokens[:end]]


@dataclass(frozen=True)
class GradingSummary:
    """What a batch's grades say besides each completion's reward (module doc).

    Attributes:
        samples: the completions graded.
        sub_rewards: a ``multi`` grader's sub-grader name -> its mean reward over the batch
            (None where that mean is not finite), at most :data:`MAX_SUB_REWARDS` names in
            the grader's order, each at most :data:`MAX_SUB_REWARD_NAME` characters; None
            for any other grader.
        errors: the completions the grader could not score (each got reward 0).
        error_kinds: each error flag of ``GradeErrors`` raised -> on how many completions
            (a ``multi``'s completion may raise several).
        error_detail: what the first failing completion's error said, if anything
            (a python grader's exception, a sandbox stop, ...), cut to
            :data:`ERROR_DETAIL_CHARS`.
    """

    samples: int
    sub_rewards: dict[str, float | None] | None = None
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    error_detail: str | None = None

    def metrics(self) -> dict[str, Any]:
        """The :data:`GRADING_KEYS` of a step's row."""
        return {"sub_rewards": self.sub_rewards, "grader_errors": self.errors}


def _error_kinds(result: GradeResult) -> list[str]:
    return [f.name for f in fields(result.errors) if getattr(result.errors, f.name) is True]


def _error_detail(result: GradeResult) -> str | None:
    e = result.errors
    text = (e.python_grader_runtime_error_details or e.model_grader_server_error_details
            or e.python_grader_server_error_type)
    return text[:ERROR_DETAIL_CHARS] if text else None


def summarize_grades(grader: Any, results: Sequence[GradeResult]) -> GradingSummary:
    """The :class:`GradingSummary` of one batch's :class:`GradeResult`s."""
    sub_rewards = None
    if isinstance(grader, MultiGrader):
        names = [n for n in grader.graders if len(n) <= MAX_SUB_REWARD_NAME][:MAX_SUB_REWARDS]
        means = {n: float(np.mean([r.sub_rewards.get(n, 0.0) for r in results], dtype=np.float64)) for n in names}
        sub_rewards = {n: m if math.isfinite(m) else None for n, m in means.items()}
    kinds: dict[str, int] = {}
    failed = [r for r in results if r.errors.any()]
    for result in failed:
        for kind in _error_kinds(result):
            kinds[kind] = kinds.get(kind, 0) + 1
    detail = next((d for d in map(_error_detail, failed) if d), None)
    return GradingSummary(samples=len(results), sub_rewards=sub_rewards, errors=len(failed), error_kinds=kinds,
                          error_detail=detail)


def grade_completions(objective: GrpoObjective, completions: Sequence[Sequence[int]],
                      items: Sequence[dict[str, Any]]) -> tuple[np.ndarray, GradingSummary]:
    """The grader's reward of each completion, ``(n,)`` float32, and the batch's
    :class:`GradingSummary`: each text decoded without special tokens, ``finish_reason``
    "stop" for one that ended at a stop token, "length" for one cut at its token budget;
    a sample the grader cannot score gets 0 (and counts in the summary's ``errors``)."""
    samples = [sample_namespace(objective.decode(c), finish_reason="stop" if c and c[-1] in objective.stop_ids
                                else "length") for c in completions]
    results = grade_batch(objective.grader, samples, items, objective.grading)
    rewards = np.array([float(r.reward) for r in results], dtype=np.float32)
    return rewards, summarize_grades(objective.grader, results)


class GraderErrorWarnings:
    """Which steps' grader errors become a ``warn`` job event, within one run of the trainer.

    The first step whose grader failed on any completion raises one, and so does a later
    step with an error kind (a ``GradeErrors`` flag) not reported yet in this run; the
    same failure repeating step after step does not. A broken grader fails on every step:
    one event tells the user why the rewards are 0, and each step's ``grader_errors``
    counts the rest. A resumed run starts afresh, so it warns again once.
    """

    def __init__(self) -> None:
        self.warned = False
        self.reported: set[str] = set()

    def warning(self, step: int, summary: GradingSummary) -> tuple[str, dict[str, Any]] | None:
        """The message and data of the event step ``step`` raises, or None."""
        first = not self.warned
        if not summary.errors or not (first or set(summary.error_kinds) - self.reported):
            return None
        self.warned = True
        self.reported |= set(summary.error_kinds)
        kinds = ", ".join(f"{kind} on {n}" for kind, n in sorted(summary.error_kinds.items()))
        message = (f"Step {step}: the grader could not score {summary.errors} of {summary.samples} completions "
                   f"({kinds}); they got reward 0.")
        if summary.error_detail:
            message += f" First error: {summary.error_detail}"
        if first:
            message += " Fix the grader (POST /v1/fine_tuning/alpha/graders/run tries it on a sample); " \
                       "later steps count their failures in grader_errors and warn again only for a new kind."
        data = {"step": step, "grader_errors": summary.errors, "samples": summary.samples,
                "error_kinds": dict(summary.error_kinds), "error_detail": summary.error_detail}
        return message, data


def group_advantages(rewards: np.ndarray, group_size: int, *, eps: float = ADVANTAGE_EPS,
                     scale: bool = True) -> np.ndarray:
    """Each completion's advantage within its prompt's group: ``(r - mean_group(r)) /
    (std_group(r) + eps)``, the std with Bessel's correction (TRL's group scaling).

    Args:
        rewards: ``(n_prompts x group_size,)`` rewards, each prompt's completions contiguous.
        group_size: completions per prompt (at least 2: one alone has no baseline).
        eps: added to the group's std.
        scale: divide by the group's std (False: the mean-centred reward, as Dr. GRPO).

    Returns:
        ``(n_prompts x group_size,)`` advantages, in ``rewards``' dtype.
    """
    rewards = np.asarray(rewards)
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(f"rewards must be a flat array of whole groups of {group_size}, got shape {rewards.shape}")
    grouped = rewards.reshape(-1, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + eps)
    return centred.reshape(-1).astype(rewards.dtype)


def step_metrics(rewards: np.ndarray, completion_lengths: Sequence[int], *, kl_sum: float | None,
                 clipped_tokens: float, grading: GradingSummary | None = None) -> dict[str, Any]:
    """A step's :data:`REINFORCEMENT_KEYS`: the rewards' mean and (Bessel) std over its
    completions, the KL per completion token (``kl_sum`` None without a reference), the
    fraction of completion tokens whose ratio was clipped and the mean completion length;
    then its :data:`GRADING_KEYS` from ``grading`` (None each without one)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    tokens = float(sum(completion_lengths))
    graded = grading.metrics() if grading is not None else dict.fromkeys(GRADING_KEYS)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(ddof=1)) if rewards.size > 1 else 0.0,
        "kl": kl_sum / tokens if kl_sum is not None else None,
        "clip_fraction": clipped_tokens / tokens,
        "completion_length": tokens / len(completion_lengths),
        **graded,
    }


def evaluation_metrics(rewards: np.ndarray) -> dict[str, float | None]:
    """An evaluation's row values: ``valid_reward_mean``; a reinforcement run has no
    validation loss or token accuracy."""
    return {"valid_loss": None, "token_accuracy": None, "valid_reward_mean": float(np.mean(rewards))}
