"""One interface for every recipe, whatever its method and framework.

A recipe is a :class:`Recipe`: the entry point (``python -m trainers``) builds one from
the class ``trainers.__main__.RECIPES`` names, and drives it with :func:`run_recipe`::

    recipe.setup(spec, reporter, stop)   # checks, data, model, optimizer, resume
    result = recipe.train()              # the loop: metric rows and checkpoints
    recipe.save()                        # the final adapter, then the manifest
    recipe.cleanup()                     # always, success or not (e.g. leave the process group)

Recipes that train (both trainers' ranks) are :class:`SteppedRecipe`: they supply one
optimizer step, an evaluation pass, a checkpoint writer and the adapter export in their
framework, and the loop around them is written once, here, with the decisions of
``trainers.common.loop``. A recipe that only starts others (the fsdp_qlora launcher,
``trainers/fsdp_qlora/launch.py``) implements :class:`Recipe` directly.

Stop contract. ``stop`` (SIGTERM, the parent gone, a test) is checked at one point only:
after a completed optimizer step, before the next one is started -- the top of each loop
iteration, so also before the first step of a run. The recipe's
:meth:`SteppedRecipe.agree_to_stop` turns the local flag into the decision every process
of the job shares (so all of them checkpoint the same step). Once stopped, the run writes
a checkpoint at the step it has completed (unless this run has just written that step's
periodic one; a stop before any step of a fresh run has nothing to write) and raises
:class:`~trainers.errors.Preempted`.
A stop requested during the last step is seen by no check: the run finishes.

Output contract, in this order, written by the primary process only (JAX process 0,
torch rank 0):

1. each step's metric row: appended to ``metrics.jsonl``, then reported (a reinforcement
   step whose grader could not score some completions may add a ``warn`` event after it:
   ``trainers.common.reinforcement.GraderErrorWarnings`` says which steps do);
2. checkpoints: every ``checkpoint.every_n_steps`` steps, and the last step's once at
   the end of :meth:`Recipe.train`;
3. :meth:`Recipe.save`: the final adapter (``<output_dir>/adapter``), the training config
   and any recipe-specific files;
4. the manifest over the output dir (``manifest.json``), then the ``artifacts`` report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.common.data import DataCursor
from trainers.common.loop import (
    check_finite,
    checkpoint_metrics,
    metric_row,
    should_checkpoint,
    should_evaluate,
)
from trainers.common.outputs import (
    ADAPTER_DIR,
    MetricsLog,
    finalize_outputs,
    write_training_config,
)
from trainers.common.reinforcement import GraderErrorWarnings, GradingSummary
from trainers.common.reporter import Reporter, reporter_from_spec
from trainers.common.signals import StopFlag
from trainers.errors import Preempted

REPORTS_FILE = "reports.jsonl"  # standalone mode; in checkpoint.dir, not in the manifest
SPOOL_DIR = ".report-spool"


@dataclass
class TrainResult:
    """What a finished :meth:`Recipe.train` leaves in memory (tests read it; the entry
    point does not).

    Attributes:
        final_step: the last optimizer step completed; None where this process trained
            nothing itself (a launcher whose ranks did).
        losses: the train loss of each step this run took, by 1-based step.
        output_dir: where :meth:`Recipe.save` writes the outputs.
        model: the trained model where the framework keeps one object for it (torch);
            None otherwise.
    """

    final_step: int | None
    losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None
    model: Any = None


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as its recipe reports it to the common loop.

    Attributes:
        loss: the step's train loss (the DPO objective for a DPO job).
        grad_norm: the gradient norm before clipping; None where not computed.
        learning_rate: the rate the step applied.
        tokens: non-padding tokens the step consumed (all processes).
        elapsed_s: wall time of the step.
        cursor_after: the data cursor after the step's last micro-batch.
        rewards: a DPO step's ``rewards/*`` metrics (a reinforcement step's
            ``REINFORCEMENT_KEYS`` and ``GRADING_KEYS``); None for supervised steps.
        grading: a reinforcement step's grading summary, where this process graded
            (the loop warns the user of grader errors from it); None otherwise.
    """

    loss: float
    grad_norm: float | None
    learning_rate: float
    tokens: int
    elapsed_s: float
    cursor_after: DataCursor
    rewards: dict[str, float] | None = None
    grading: GradingSummary | None = None


@dataclass
class Progress:
    """Where the loop is: what a checkpoint records and a resume restores.

    Attributes:
        step: optimizer steps completed (0 before the first; the checkpoint's step after a resume).
        cursor: the data cursor after ``step``.
        tokens_seen: tokens consumed since the start of training.
        metrics: what the next checkpoint records (``trainers.common.loop.checkpoint_metrics``).
        checkpointed_step: the step of the last checkpoint this run wrote, if any.
    """

    step: int = 0
    cursor: DataCursor = field(default_factory=DataCursor)
    tokens_seen: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpointed_step: int | None = None


class Recipe(ABC):
    """A trainer recipe; driven by :func:`run_recipe` (module docstring: the order, the
    stop contract and the output contract)."""

    @abstractmethod
    def setup(self, spec: Any, reporter: Reporter, stop: StopFlag) -> None:
        """Check the spec, then prepare the run: data, model, optimizer, resume.

        ``reporter`` is the job's (only the primary process reports); ``stop`` is the flag
        polled between steps. Raises the ``trainers.errors`` the user can act on.
        """

    @abstractmethod
    def train(self) -> TrainResult:
        """Run the optimizer steps left; raises Preempted when stopped (after a checkpoint)."""

    @abstractmethod
    def save(self) -> None:
        """Write the final adapter and outputs, then the manifest."""

    @abstractmethod
    def cleanup(self) -> None:
        """Release what :meth:`setup` acquired; called after any outcome, also when
        :meth:`setup` failed part way."""


RecipeFactory = Callable[[], Recipe]


def standalone_reporter(spec: Any) -> Reporter:
    """The reporter of a run started on its own (``spec.report``): the spool and the local
    report file live in the checkpoint dir, so a restarted run re-sends what was not
    acknowledged and never reuses a seq."""
    root = Path(spec.checkpoint.dir)
    return reporter_from_spec(spec.report, default_spool_dir=root / SPOOL_DIR, local_path=root / REPORTS_FILE)


def run_recipe(recipe: Recipe, spec: Any, *, reporter: Reporter | None = None,
               stop: StopFlag | None = None) -> TrainResult:
    """setup, train, save; cleanup whatever happened.

    ``reporter`` None (tests, benchmarks): a :func:`standalone_reporter`, closed on return;
    ``stop`` None: a flag nothing sets but the recipe's own hooks.
    """
    own_reporter = reporter is None
    if reporter is None:
        reporter = standalone_reporter(spec)
    try:
        try:
            recipe.setup(spec, reporter, stop or StopFlag())
            result = recipe.train()
            recipe.save()
            return result
        finally:
            recipe.cleanup()
    finally:
        if own_reporter:
            reporter.close()


class SteppedRecipe(Recipe):
    """A recipe whose loop is the common one (:meth:`train`, :meth:`save`).

    A subclass's :meth:`setup` must set, besides what its hooks need: ``spec``,
    ``reporter``, ``stop``, ``primary`` (whether this process reports and writes files),
    ``total_steps``, ``has_validation``, ``progress`` (restored on resume),
    ``metrics_log`` (primary only) and ``output_dir``; ``model`` optionally.

    Args:
        on_step: called with the step number after each step's metric row (tests use it
            to request a stop after a precise step).
    """

    spec: Any
    reporter: Reporter
    stop: StopFlag
    primary: bool
    total_steps: int
    has_validation: bool
    progress: Progress
    metrics_log: MetricsLog | None
    output_dir: Path
    model: Any = None

    def __init__(self, *, on_step: Callable[[int], None] | None = None) -> None:
        self.on_step = on_step
        self.losses: dict[int, float] = {}

    # -- what a recipe supplies ------------------------------------------------------------

    @abstractmethod
    def train_step(self, step: int) -> StepResult:
        """Take optimizer step ``step + 1`` (``step`` completed so far) on the next batch."""

    @abstractmethod
    def evaluate(self) -> dict[str, Any]:
        """One pass over the validation set: ``valid_loss``, ``token_accuracy`` (DPO:
        also ``valid_rewards/*``). Every process runs it."""

    @abstractmethod
    def memory_bytes(self) -> int | None:
        """The memory figure of a metric row (peak accelerator bytes, else host RSS)."""

    @abstractmethod
    def write_checkpoint(self, progress: Progress) -> Path | None:
        """Checkpoint the state at ``progress`` (every process joins; the primary reports
        it). Returns its directory where this process knows it."""

    @abstractmethod
    def export_adapter(self, adapter_dir: Path) -> None:
        """The trained adapter as a finished PEFT adapter dir (every process joins the
        gathers; the primary writes)."""

    @property
    def eval_every_n_steps(self) -> int | None:
        """The evaluation cadence: ``eval.every_n_steps``; when it is unset, a reinforcement
        job's own (OpenAI's ``eval_interval``)."""
        if self.spec.eval.every_n_steps is None and self.spec.method.type == "reinforcement":
            return self.spec.method.reinforcement.eval_interval
        return self.spec.eval.every_n_steps

    def agree_to_stop(self, requested: bool) -> bool:
        """Whether the job stops now, the same answer on every process (a collective where
        the processes must agree). One process, or one that decides alone: its own flag."""
        return requested

    def write_extra_outputs(self, output_dir: Path) -> None:
        """Recipe-specific output files, written before the manifest (primary only)."""

    def finish(self) -> None:
        """After the outputs, on every process (e.g. a barrier so ranks exit together)."""

    # -- the loop ------------------------------------------------------------------------

    def train(self) -> TrainResult:
        spec, p = self.spec, self.progress
        grader_warnings = GraderErrorWarnings()
        while p.step < self.total_steps:
            if self.agree_to_stop(self.stop.requested):
                self._preempt()
            out = self.train_step(p.step)
            check_finite(p.step + 1, out.loss, out.grad_norm)
            p.step, p.cursor = p.step + 1, out.cursor_after
            p.tokens_seen += out.tokens
            self.losses[p.step] = out.loss
            evaluation = None
            if should_evaluate(p.step, total_steps=self.total_steps, every_n_steps=self.eval_every_n_steps,
                               has_validation=self.has_validation):
                evaluation = self.evaluate()
            row = metric_row(
                step=p.step, total_steps=self.total_steps, cursor_after=p.cursor, train_loss=out.loss,
                learning_rate=out.learning_rate, grad_norm=out.grad_norm, step_tokens=out.tokens,
                elapsed_s=out.elapsed_s, tokens_seen=p.tokens_seen, memory_bytes=self.memory_bytes(),
                evaluation=evaluation, rewards=out.rewards,
            )
            p.metrics = checkpoint_metrics(row, p.metrics)
            if self.primary:
                assert self.metrics_log is not None
                self.metrics_log.append(row)
                self.reporter.metric(**row)
                warning = grader_warnings.warning(p.step, out.grading) if out.grading is not None else None
                if warning is not None:
                    self.reporter.event(warning[0], level="warn", data=warning[1])
            if self.on_step is not None:
                self.on_step(p.step)
            if should_checkpoint(p.step, total_steps=self.total_steps, every_n_steps=spec.checkpoint.every_n_steps):
                self._checkpoint()
        self._checkpoint()  # the last step's, once, before the adapter is exported
        return TrainResult(final_step=p.step, losses=dict(self.losses), output_dir=self.output_dir,
                           model=self.model)

    def save(self) -> None:
        self.export_adapter(self.output_dir / ADAPTER_DIR)
        if self.primary:
            write_training_config(self.output_dir, self.spec)
            self.write_extra_outputs(self.output_dir)
            files = finalize_outputs(self.output_dir)
            self.reporter.artifacts(str(self.output_dir), files)
            self.reporter.event(f"training finished after {self.progress.step} steps; adapter exported",
                                data={"step": self.progress.step,
                                      "train_loss": self.progress.metrics.get("train_loss")})
        self.finish()

    def _checkpoint(self) -> Path | None:
        path = self.write_checkpoint(self.progress)
        self.progress.checkpointed_step = self.progress.step
        return path

    def _preempt(self) -> None:
        """Checkpoint the completed step (if it has none yet) and raise Preempted."""
        p, name = self.progress, self.stop.signal_name
        if p.step == 0:
            raise Preempted(f"stopped by {name} before the first step; nothing to checkpoint")
        if p.checkpointed_step != p.step:
            self._checkpoint()
        if self.primary:
            self.reporter.event(f"preempted ({name}) at step {p.step}; checkpoint written")
        raise Preempted(f"stopped by {name} at step {p.step}; resume from the checkpoint")
