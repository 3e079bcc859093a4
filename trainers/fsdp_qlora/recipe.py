"""The PyTorch (Q)LoRA recipe of ONE rank: :class:`FsdpQloraRecipe` trains a LoRA adapter on a Llama.

Read top to bottom: setup (layout checks, process group, seeds), data, model (meta
skeleton, quantize, LoRA, shard, stream weights), optimizer, resume; then the hooks of
the common loop (step, eval, checkpoint, adapter export, the stop agreed on by all
ranks), cleanup. The loop itself (metrics, eval cadence, checkpoints, preemption,
outputs) is ``trainers.common.recipe``'s. QLoRA is this LoRA recipe with a quantized base; one process is this recipe
with a world of one (no process group, no FSDP wrapping). Starting N ranks, relaying
rank 0's reports and turning a rank's failure into the job's error is the launcher's
business (``launch.py``, which ``python -m trainers`` calls).

Reusable parts live in the sibling modules: the model build (``loading.build_model``),
the step and the eval pass (``train_step``: global-token loss, ``no_sync``
accumulation, DTensor clipping), the checkpoint (DCP shards, ``checkpoint.py``). What
is shared with the JAX trainer lives in ``trainers.common``: data pipeline, schedule,
resume rule, eval cadence, metric row, epoch numbering, NaN policy, reporter,
checkpoint layout and PEFT exporter.

The run's first step confirms the scheduler's micro batch and activation checkpointing
by its measured peak and, if it does not fit the device, is taken again with the next
choice that does (``step_fit.py``).

Per optimizer step: read ``batch_size / micro_batch_size`` micro-batches at the data
cursor (each rank keeps its share), back-propagate each with ``sum(token losses) /
label tokens of the whole step`` (so the update depends neither on how the step is
split into micro-batches nor on the world size), clip, AdamW-update the LoRA
parameters with the shared schedule's learning rate. A DPO job (``method.type`` dpo)
reads preference pairs instead and back-propagates the DPO objective, normalized the
same way over the step's pairs; its reference policy is this model with the adapter
switched off (``train_step.preference_backward``). A reinforcement job (``method.type``
reinforcement, one process only) reads ``batch_size`` prompts per step, samples and
grades ``samples_per_prompt`` completions of each and back-propagates GRPO's loss on them
(``grpo_step``). A resumed run reproduces the
uninterrupted one: the checkpoint holds the adapter, the AdamW state, the data cursor
and the RNG states.

Only rank 0 reports and writes files; every rank runs every forward (FSDP all-gathers
are collectives), evaluation included. SIGTERM is agreed on by all ranks at each step
boundary (an all-reduce), so they checkpoint the same step.
"""

from __future__ import annotations

import gc
import json
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainers.common.checkpointing import (
    TrainerState,
    capture_host_rng,
    load_trainer_state,
    report_resumed,
    resolve_resume,
    restore_host_rng,
)
from trainers.common.job_data import (
    check_inputs_exist,
    load_tokenizer,
    total_optimizer_steps,
)
from trainers.common.lineage import write_job_adapter
from trainers.common.loop import epoch_of_step
from trainers.common.memory import (
    FAST_MMAP_THRESHOLD,
    FIXED_MMAP_THRESHOLD,
    keeps_a_fast_heap,
    return_freed_tensors_to_the_os,
)
from trainers.common.outputs import MetricsLog
from trainers.common.preference import load_training_data
from trainers.common.recipe import Progress, SteppedRecipe, StepResult, TrainResult, run_recipe
from trainers.common.reinforcement import GrpoObjective, grpo_objective, load_reinforcement_data
from trainers.common.schedules import learning_rate_at
from trainers.common.step_fit import declared_limit_bytes, fallback_steps
from trainers.errors import OutOfMemory, UserError
from trainers.fsdp_qlora.checkpoint import (
    gather_adapter_state,
    load_sharded,
    peft_weights,
    save_checkpoint_distributed,
)
from trainers.fsdp_qlora.distributed import (
    DistContext,
    accelerator_available,
    all_reduce_sum,
    apply_activation_checkpointing,
    barrier,
    check_parallelism,
    destroy_distributed,
    init_distributed,
)
from trainers.fsdp_qlora.grpo_step import evaluate_rewards, grpo_train_step
from trainers.fsdp_qlora.loading import build_model, options_from_spec
from trainers.fsdp_qlora.step_fit import (
    CHECKPOINTING_ORDER,
    MeasuredStep,
    PeakMemory,
    TrainableState,
    device_limit_bytes,
    with_step,
)
from trainers.fsdp_qlora.train_step import (
    PreferenceObjective,
    build_optimizer,
    dpo_train_step,
    evaluate,
    evaluate_preference,
    rank_share,
    train_step,
)


class FsdpQloraRecipe(SteppedRecipe):
    """The (Q)LoRA recipe of one rank (:class:`~trainers.common.recipe.Recipe`):
    :meth:`setup` joins the process group and builds data, model and optimizer (and
    resumes); the loop, the stop and output contracts are ``trainers.common.recipe``'s.
    Every rank runs it; only rank 0 reports and writes files."""

    ctx: DistContext | None = None
    grpo: GrpoObjective | None = None  # set by setup() for a reinforcement job
    step_confirmed = False  # the run's first step measured and fitting (step_fit.py)

    def setup(self, spec: Any, reporter: Any, stop: Any) -> None:
        # -- setup: layout checks before anything heavy -----------------------------------
        hp, par, a = spec.hyperparameters, spec.parallelism, spec.adapter
        self.spec, self.reporter, self.stop = spec, reporter, stop
        # Before the load: the loader's and the steps' freed tensors then leave the process
        # (trainers.common.memory explains the heap growth this prevents), unless the step
        # runs on the host with room to spare, where the bound would cost it its speed: the
        # heap then keeps freed tensors below FAST_MMAP_THRESHOLD for the next step.
        fast_heap = keeps_a_fast_heap(on_host=not accelerator_available(), planned_bytes=par.planned_memory_bytes,
                                      limit_bytes=declared_limit_bytes(spec))
        heap_bounded = return_freed_tensors_to_the_os(FAST_MMAP_THRESHOLD if fast_heap else FIXED_MMAP_THRESHOLD)
        check_reinforcement_layout(spec)
        check_parallelism(world_size=par.world_size, batch_size=hp.batch_size, micro_batch_size=hp.micro_batch_size,
                          cpu_offload=par.cpu_offload, has_accelerator=accelerator_available())
        resume_path = resolve_resume(spec.checkpoint)  # a bad resume_from fails before any load
        self.ctx = ctx = init_distributed()
        self.primary = ctx.is_main
        self.peak = PeakMemory(ctx.device)
        if ctx.world_size != par.world_size:
            raise UserError(f"the spec asks for world_size {par.world_size} but the environment has "
                            f"{ctx.world_size} processes", code="invalid_parallelism")
        check_inputs_exist(spec)
        random.seed(spec.seed)
        np.random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        self.output_dir = output_dir = Path(spec.output_dir)
        if ctx.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            reporter.event("trainer started", data={"trainer": "fsdp_qlora", "world_size": ctx.world_size,
                                                    "device": str(ctx.device), "quantization": a.quantization,
                                                    "fixed_mmap_threshold": heap_bounded,
                                                    # "unchanged": an operator's choice, or no glibc
                                                    "heap": ("fast" if fast_heap else "bounded") if heap_bounded
                                                    else "unchanged"})

        # -- data (every rank reads the same global order; each keeps its share) ----------
        tokenizer = load_tokenizer(spec.model.path)
        # DPO reads preference pairs: a micro-batch is micro_batch_size pairs, chosen then
        # rejected rows (trainers.common.preference); the rest of the loop is the same.
        self.dpo = PreferenceObjective(spec.method.beta, spec.method.sft_weight) if spec.method.type == "dpo" else None
        # Reinforcement reads prompts: a step is batch_size prompts, sampled and graded.
        self.grpo = grpo_objective(spec, tokenizer) if spec.method.type == "reinforcement" else None
        self.data = data = (load_reinforcement_data(spec, tokenizer) if self.grpo
                            else load_training_data(spec, tokenizer))
        self.has_validation = data.validation is not None
        self.total_steps = total_steps = total_optimizer_steps(spec, data.train)  # type: ignore[arg-type]
        self.micro_per_step = hp.batch_size // hp.micro_batch_size  # global micro-batches per step

        # -- model: meta skeleton -> quantize -> LoRA -> shard -> stream weights ----------
        # A job that continues a fine-tuned model gets its adapter frozen beside the trained one.
        self.options = options = options_from_spec(spec)
        self.model, load_report = build_model(options, ctx)
        if ctx.is_main:
            reporter.event("model loaded", data={**load_report.as_event_data(), "total_steps": total_steps,
                                                 **data.stats()})
            if data.train.dataset.n_truncated:
                reporter.event(f"{data.train.dataset.n_truncated} example(s) truncated to "
                               f"max_seq_len={spec.data.max_seq_len}", level="warning")

        # -- optimizer: AdamW over the LoRA parameters; lr set per step from the schedule --
        self.optimizer = build_optimizer(self.model, learning_rate=hp.learning_rate, weight_decay=hp.weight_decay)

        # -- resume -----------------------------------------------------------------------
        self.progress = progress = Progress()
        if resume_path is not None:
            load_sharded(resume_path, self.model, self.optimizer, ctx)
            state = load_trainer_state(resume_path)
            restore_host_rng(state.rng)
            progress.step, progress.cursor = state.step, state.cursor
            progress.tokens_seen = int(state.extra.get("tokens_seen", 0))
            progress.metrics = dict(state.metrics)
            if ctx.is_main:
                reporter.event(f"resumed from {resume_path.name}",
                               data={"step": progress.step, "cursor": progress.cursor.to_dict()})
        self.metrics_log = (MetricsLog(output_dir, resume_step=progress.step if resume_path is not None else None)
                            if ctx.is_main else None)
        if resume_path is not None and ctx.is_main:
            assert self.metrics_log is not None
            report_resumed(reporter, spec.checkpoint.dir, resume_path, state, self.metrics_log.rows(),
                           every_n_steps=spec.checkpoint.every_n_steps)
        self.batches = None if self.grpo else data.train.micro_batches(progress.cursor)
        # Without FSDP there is no mixed-precision policy: autocast does the casting.
        self.autocast = (
            torch.autocast(ctx.device.type, dtype=getattr(torch, spec.precision.compute_dtype))
            if not ctx.distributed and spec.precision.compute_dtype != spec.precision.base_dtype
            else nullcontext()
        )

    # -- the hooks of the common loop ------------------------------------------------------

    def train_step(self, step: int) -> StepResult:
        if not self.step_confirmed:
            return self._confirmed_first_step(step)
        return self._take_step(step)

    def _confirmed_first_step(self, step: int) -> StepResult:
        """The run's first step with the planned choice, confirmed by its measured peak, or
        taken again with the next choice in the speed order until one fits (``step_fit``)."""
        spec, ctx, peak = self.spec, self._ctx, self.peak
        hp, par = spec.hyperparameters, spec.parallelism
        measurable = peak.reset()  # the step's own peak from here; False: this kernel cannot reset VmHWM
        limit = device_limit_bytes(spec, ctx.device) if measurable else None
        # A rank that runs out of memory alone would leave the others waiting in a
        # collective: only a single process steps down from an out-of-memory error.
        catch_oom = ctx.world_size == 1
        planned = (hp.micro_batch_size, par.activation_checkpointing)
        candidates = [planned]
        if limit is not None or catch_oom:
            candidates += fallback_steps(hp.batch_size // ctx.world_size, *planned, order=CHECKPOINTING_ORDER)
        saved = TrainableState(self.model, self.optimizer) if len(candidates) > 1 else None
        tried: list[MeasuredStep] = []
        for micro, checkpointing in candidates:
            if tried:
                assert saved is not None
                saved.restore()
                self._use_step(micro, checkpointing)
                peak.reset()
            try:
                out: StepResult | None = self._take_step(step)
            except torch.OutOfMemoryError:
                if not catch_oom:
                    raise
                out = None
            if out is None:  # outside the except block: its traceback no longer holds the step's tensors
                self.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
            peaks = all_reduce_sum([peak.read() if r == ctx.rank else 0.0 for r in range(ctx.world_size)], ctx)
            tried.append(MeasuredStep(micro, checkpointing, None if out is None else int(max(peaks)), limit))
            if tried[-1].fits:
                break
        else:
            raise OutOfMemory("no step fits one device: " + "; ".join(fit.describe() for fit in tried[:4])
                              + (f" (and {len(tried) - 4} more)" if len(tried) > 4 else ""))
        if ctx.is_main:
            if len(tried) > 1:
                over = "" if tried[0].peak_bytes is None else " does not fit"  # an error says so itself
                self.reporter.event(
                    f"step stepped down: {tried[0].describe()}{over}; running {tried[-1].describe()}",
                    level="warning", data={"step": {"micro_batch": micro, "activation_checkpointing": checkpointing},
                                           "tried": [vars(fit) for fit in tried]})
            else:
                self.reporter.event(f"step confirmed: {tried[-1].describe()}",
                                    data={"peak_bytes": tried[-1].peak_bytes, "limit_bytes": limit})
        self.step_confirmed = True
        assert out is not None
        return out

    def _use_step(self, micro_batch: int, checkpointing: str) -> None:
        """Run the next steps (and evaluations) with ``micro_batch`` and ``checkpointing``,
        reading the data again from the cursor the first step starts at."""
        if checkpointing != self.spec.parallelism.activation_checkpointing:
            apply_activation_checkpointing(self.model, checkpointing)
        self.spec = with_step(self.spec, micro_batch, checkpointing)
        self.micro_per_step = self.spec.hyperparameters.batch_size // micro_batch
        for data in (self.data.train, self.data.validation):
            if data is not None:
                data.micro_batch_size = micro_batch
        self.batches = None if self.grpo else self.data.train.micro_batches(self.progress.cursor)

    def _take_step(self, step: int) -> StepResult:
        hp, ctx = self.spec.hyperparameters, self._ctx
        started = time.perf_counter()
        lr = learning_rate_at(step, base_lr=hp.learning_rate, total_steps=self.total_steps,
                              warmup_steps=hp.warmup_steps, kind=hp.lr_scheduler)
        if self.grpo:
            prompts, cursor_after = self.data.train.take(self.progress.cursor, hp.batch_size)
            with self.autocast:
                stats = grpo_train_step(self.model, self.optimizer, prompts, ctx, self.grpo, step=step,
                                        seed=self.spec.seed, micro_batch_size=hp.micro_batch_size,
                                        learning_rate=lr, max_grad_norm=hp.max_grad_norm)
            return StepResult(loss=stats.loss, grad_norm=stats.grad_norm, learning_rate=lr, tokens=stats.tokens,
                              elapsed_s=time.perf_counter() - started, cursor_after=cursor_after,
                              rewards=stats.rewards, grading=stats.grading)
        assert self.batches is not None
        micro = [next(self.batches) for _ in range(self.micro_per_step)]
        with self.autocast:
            if self.dpo:
                stats = dpo_train_step(self.model, self.optimizer, rank_share(micro, ctx), ctx, self.dpo, step=step,
                                       seed=self.spec.seed, learning_rate=lr, max_grad_norm=hp.max_grad_norm)
            else:
                stats = train_step(self.model, self.optimizer, rank_share(micro, ctx), ctx, step=step,
                                   seed=self.spec.seed, learning_rate=lr, max_grad_norm=hp.max_grad_norm)
        return StepResult(loss=stats.loss, grad_norm=stats.grad_norm, learning_rate=lr, tokens=stats.tokens,
                          elapsed_s=time.perf_counter() - started, cursor_after=micro[-1].cursor_after,
                          rewards=stats.rewards)

    def evaluate(self) -> dict[str, Any]:
        max_batches = self.spec.eval.max_batches
        if self.grpo:
            with self.autocast:
                return evaluate_rewards(self.model, self.data.validation, self._ctx, max_batches, self.grpo,
                                        seed=self.spec.seed, step=self.progress.step)
        if self.dpo:
            return evaluate_preference(self.model, self.data.validation, self._ctx, max_batches, self.dpo)
        return evaluate(self.model, self.data.validation, self._ctx, max_batches)

    def memory_bytes(self) -> int | None:
        return self.peak.since_start()

    def agree_to_stop(self, requested: bool) -> bool:
        return _agree_to_stop(requested, self._ctx)

    def _write_adapter(self, d: Path, adapter: dict[str, torch.Tensor]) -> None:
        """The gathered ``adapter`` (folded with a frozen parent's) as a finished PEFT adapter
        directory (rank 0 only)."""
        write_job_adapter(d, peft_weights(adapter), self.spec, self.options.parent)

    def write_checkpoint(self, progress: Progress) -> Path:
        ctx, spec = self._ctx, self.spec
        adapter = gather_adapter_state(self.model)  # collective: every rank
        state = TrainerState(step=progress.step, epoch=epoch_of_step(progress.cursor), cursor=progress.cursor,
                             rng=capture_host_rng(), metrics=dict(progress.metrics),
                             extra={"tokens_seen": progress.tokens_seen, "world_size": ctx.world_size})
        # Rank 0 reports it: its metrics are spooled before the rename, its listing after.
        return save_checkpoint_distributed(spec.checkpoint.dir, state, self.model, self.optimizer, ctx,
                                           keep_last=spec.checkpoint.keep_last,
                                           write_adapter=lambda d: self._write_adapter(d, adapter),
                                           reporter=self.reporter if ctx.is_main else None)

    def export_adapter(self, adapter_dir: Path) -> None:
        adapter = gather_adapter_state(self.model)  # collective: every rank
        if self._ctx.is_main:
            self._write_adapter(adapter_dir, adapter)

    def write_extra_outputs(self, output_dir: Path) -> None:
        (output_dir / "data_stats.json").write_text(json.dumps(self.data.stats(), indent=2), encoding="utf-8")

    def finish(self) -> None:
        barrier(self._ctx)

    def cleanup(self) -> None:
        # Leave the process group even on failure (ranks exit together); a no-op when
        # setup failed before joining one.
        destroy_distributed()

    @property
    def _ctx(self) -> DistContext:
        assert self.ctx is not None, "setup() joins the process group first"
        return self.ctx


def run(spec: Any, *, reporter: Any = None, stop: Any = None) -> TrainResult:
    """Train and export the adapter described by ``spec``, as one rank of the job, in this
    process (tests; the entry point and ``launch.py`` drive :class:`FsdpQloraRecipe`).

    Raises:
        UserError, Preempted, OutOfMemory: see ``trainers.errors``.
    """
    return run_recipe(FsdpQloraRecipe(), spec, reporter=reporter, stop=stop)


def check_reinforcement_layout(spec: Any) -> None:
    """Refuse a reinforcement job this trainer cannot run: more than one rank (sampling
    would need every FSDP rank to decode in lockstep; one process samples alone)."""
    if spec.method.type == "reinforcement" and spec.parallelism.world_size > 1:
        raise UserError(
            f"reinforcement fine-tuning runs on one process (one GPU) on the fsdp_qlora trainer; this job asks "
            f"for world_size {spec.parallelism.world_size}: set parallelism.world_size to 1",
            code="reinforcement_multi_rank",
        )


def _agree_to_stop(requested: bool, ctx: DistContext) -> bool:
    """True on every rank if SIGTERM reached any of them (so all checkpoint one step)."""
    return all_reduce_sum([1.0 if requested else 0.0], ctx)[0] > 0
