"""The PyTorch (Q)LoRA recipe of ONE rank: ``run(spec)`` trains a LoRA adapter on a Llama.

Read top to bottom: setup (layout checks, process group, seeds), data, model (meta
skeleton, quantize, LoRA, shard, stream weights), optimizer, resume, the train loop
(step, metrics, eval, checkpoint, preemption), save (final checkpoint and export),
cleanup. QLoRA is this LoRA recipe with a quantized base; one process is this recipe
with a world of one (no process group, no FSDP wrapping). Starting N ranks, relaying
rank 0's reports and turning a rank's failure into the job's error is the launcher's
business (``launch.py``, which ``python -m trainers`` calls).

Reusable parts live in the sibling modules: the model build (``loading.build_model``),
the step and the eval pass (``train_step``: global-token loss, ``no_sync``
accumulation, DTensor clipping), the checkpoint (DCP shards, ``checkpoint.py``). What
is shared with the JAX trainer lives in ``trainers.common``: data pipeline, schedule,
resume rule, eval cadence, metric row, epoch numbering, NaN policy, reporter,
checkpoint layout and PEFT exporter.

Per optimizer step: read ``batch_size / micro_batch_size`` micro-batches at the data
cursor (each rank keeps its share), back-propagate each with ``sum(token losses) /
label tokens of the whole step`` (so the update depends neither on how the step is
split into micro-batches nor on the world size), clip, AdamW-update the LoRA
parameters with the shared schedule's learning rate. A DPO job (``method.type`` dpo)
reads preference pairs instead and back-propagates the DPO objective, normalized the
same way over the step's pairs; its reference policy is this model with the adapter
switched off (``train_step.preference_backward``). A resumed run reproduces the
uninterrupted one: the checkpoint holds the adapter, the AdamW state, the data cursor
and the RNG states.

Only rank 0 reports and writes files; every rank runs every forward (FSDP all-gathers
are collectives), evaluation included. SIGTERM is agreed on by all ranks at each step
boundary (an all-reduce), so they checkpoint the same step.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainers.common.checkpointing import (
    TrainerState,
    capture_host_rng,
    load_trainer_state,
    report_resumed,
    resolve_resume,
    restore_host_rng,
)
from trainers.common.data import DataCursor
from trainers.common.job_data import (
    check_inputs_exist,
    load_tokenizer,
    total_optimizer_steps,
)
from trainers.common.loop import (
    check_finite,
    checkpoint_metrics,
    epoch_of_step,
    metric_row,
    should_evaluate,
)
from trainers.common.memory import return_freed_tensors_to_the_os
from trainers.common.outputs import (
    ADAPTER_DIR,
    MetricsLog,
    finalize_outputs,
    finish_adapter,
    write_training_config,
)
from trainers.common.peft_export import write_peft_adapter
from trainers.common.preference import load_training_data
from trainers.common.schedules import learning_rate_at
from trainers.errors import Preempted, UserError
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
    barrier,
    check_parallelism,
    destroy_distributed,
    init_distributed,
)
from trainers.fsdp_qlora.loading import build_model, options_from_spec
from trainers.fsdp_qlora.train_step import (
    PreferenceObjective,
    build_optimizer,
    dpo_train_step,
    evaluate,
    evaluate_preference,
    rank_share,
    train_step,
)


@dataclass
class RunResult:
    """What a finished run leaves in memory (used by tests; the entry point ignores it)."""

    model: nn.Module
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None


def run(spec: Any, *, reporter: Any, stop: Any) -> RunResult:
    """Train and export the adapter described by ``spec``, as one rank of the job.

    Args:
        reporter: where reports go; only rank 0 uses it.
        stop: the SIGTERM flag; polled (and agreed on by all ranks) between steps.

    Raises:
        UserError, Preempted, OutOfMemory: see ``trainers.errors``.
    """
    # -- setup: layout checks before anything heavy ---------------------------------------
    hp, par, a = spec.hyperparameters, spec.parallelism, spec.adapter
    # Before the load: the loader's and the steps' freed tensors then leave the process
    # (trainers.common.memory explains the heap growth this prevents).
    heap_bounded = return_freed_tensors_to_the_os()
    check_parallelism(world_size=par.world_size, batch_size=hp.batch_size, micro_batch_size=hp.micro_batch_size,
                      cpu_offload=par.cpu_offload, has_accelerator=accelerator_available())
    resume_path = resolve_resume(spec.checkpoint)  # a bad resume_from fails before any load
    ctx = init_distributed()
    try:
        if ctx.world_size != par.world_size:
            raise UserError(f"the spec asks for world_size {par.world_size} but the environment has "
                            f"{ctx.world_size} processes", code="invalid_parallelism")
        check_inputs_exist(spec)
        random.seed(spec.seed)
        np.random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        output_dir = Path(spec.output_dir)
        if ctx.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            reporter.event("trainer started", data={"trainer": "fsdp_qlora", "world_size": ctx.world_size,
                                                    "device": str(ctx.device), "quantization": a.quantization,
                                                    "fixed_mmap_threshold": heap_bounded})

        # -- data (every rank reads the same global order; each keeps its share) ----------
        tokenizer = load_tokenizer(spec.model.path)
        # DPO reads preference pairs: a micro-batch is micro_batch_size pairs, chosen then
        # rejected rows (trainers.common.preference); the rest of the loop is the same.
        dpo = PreferenceObjective(spec.method.beta, spec.method.sft_weight) if spec.method.type == "dpo" else None
        data = load_training_data(spec, tokenizer)
        total_steps = total_optimizer_steps(spec, data.train)
        micro_per_step = hp.batch_size // hp.micro_batch_size  # global micro-batches per step

        # -- model: meta skeleton -> quantize -> LoRA -> shard -> stream weights ----------
        model, load_report = build_model(options_from_spec(spec), ctx)
        if ctx.is_main:
            reporter.event("model loaded", data={**load_report.as_event_data(), "total_steps": total_steps,
                                                 **data.stats()})
            if data.train.dataset.n_truncated:
                reporter.event(f"{data.train.dataset.n_truncated} example(s) truncated to "
                               f"max_seq_len={spec.data.max_seq_len}", level="warning")

        # -- optimizer: AdamW over the LoRA parameters; lr set per step from the schedule --
        optimizer = build_optimizer(model, learning_rate=hp.learning_rate, weight_decay=hp.weight_decay)

        # -- resume -----------------------------------------------------------------------
        step, cursor, tokens_seen = 0, DataCursor(), 0
        last: dict[str, Any] = {}  # the metrics the next checkpoint records
        if resume_path is not None:
            load_sharded(resume_path, model, optimizer, ctx)
            state = load_trainer_state(resume_path)
            restore_host_rng(state.rng)
            step, cursor = state.step, state.cursor
            tokens_seen = int(state.extra.get("tokens_seen", 0))
            last = dict(state.metrics)
            if ctx.is_main:
                reporter.event(f"resumed from {resume_path.name}", data={"step": step, "cursor": cursor.to_dict()})
        metrics_log = MetricsLog(output_dir, resume_step=step if resume_path is not None else None) if ctx.is_main else None
        if resume_path is not None and ctx.is_main:
            report_resumed(reporter, spec.checkpoint.dir, resume_path, state, metrics_log.rows(),
                           every_n_steps=spec.checkpoint.every_n_steps)
        batches = data.train.micro_batches(cursor)
        # Without FSDP there is no mixed-precision policy: autocast does the casting.
        autocast = (
            torch.autocast(ctx.device.type, dtype=getattr(torch, spec.precision.compute_dtype))
            if not ctx.distributed and spec.precision.compute_dtype != spec.precision.base_dtype
            else nullcontext()
        )

        def write_adapter(d: Path, adapter: dict[str, torch.Tensor]) -> None:
            """The gathered ``adapter`` as a finished PEFT adapter directory (rank 0 only)."""
            write_peft_adapter(d, peft_weights(adapter), r=a.r, alpha=a.alpha, dropout=a.dropout,
                               target_modules=a.target_modules, base_model_name_or_path=spec.model.path)
            finish_adapter(d, spec)

        def checkpoint_now() -> Path:
            adapter = gather_adapter_state(model)  # collective: every rank
            state = TrainerState(step=step, epoch=epoch_of_step(cursor), cursor=cursor, rng=capture_host_rng(),
                                 metrics=dict(last), extra={"tokens_seen": tokens_seen,
                                                            "world_size": ctx.world_size})
            # Rank 0 reports it: its metrics are spooled before the rename, its listing after.
            return save_checkpoint_distributed(spec.checkpoint.dir, state, model, optimizer, ctx,
                                               keep_last=spec.checkpoint.keep_last,
                                               write_adapter=lambda d: write_adapter(d, adapter),
                                               reporter=reporter if ctx.is_main else None)

        # -- train loop ---------------------------------------------------------------------
        losses: dict[int, float] = {}
        while step < total_steps:
            if _agree_to_stop(stop.requested, ctx):
                if step == 0:
                    raise Preempted("SIGTERM before the first step; nothing to checkpoint")
                path = checkpoint_now()
                raise Preempted(f"SIGTERM at step {step}; checkpoint {path}")
            started = time.perf_counter()
            micro = [next(batches) for _ in range(micro_per_step)]
            lr = learning_rate_at(step, base_lr=hp.learning_rate, total_steps=total_steps,
                                  warmup_steps=hp.warmup_steps, kind=hp.lr_scheduler)
            with autocast:
                if dpo:
                    stats = dpo_train_step(model, optimizer, rank_share(micro, ctx), ctx, dpo, step=step,
                                           seed=spec.seed, learning_rate=lr, max_grad_norm=hp.max_grad_norm)
                else:
                    stats = train_step(model, optimizer, rank_share(micro, ctx), ctx, step=step, seed=spec.seed,
                                       learning_rate=lr, max_grad_norm=hp.max_grad_norm)
            check_finite(step + 1, stats.loss, stats.grad_norm)
            step += 1
            cursor = micro[-1].cursor_after
            tokens_seen += stats.tokens
            elapsed = time.perf_counter() - started
            losses[step] = stats.loss
            evaluated = None
            if should_evaluate(step, total_steps=total_steps, every_n_steps=spec.eval.every_n_steps,
                               has_validation=data.validation is not None):
                evaluated = (evaluate_preference(model, data.validation, ctx, spec.eval.max_batches, dpo) if dpo
                             else evaluate(model, data.validation, ctx, spec.eval.max_batches))
            row = metric_row(
                step=step, total_steps=total_steps, cursor_after=cursor, train_loss=stats.loss, learning_rate=lr,
                grad_norm=stats.grad_norm, step_tokens=stats.tokens, elapsed_s=elapsed, tokens_seen=tokens_seen,
                memory_bytes=_memory_bytes(ctx), evaluation=evaluated, rewards=stats.rewards,
            )
            last = checkpoint_metrics(row, last)
            if ctx.is_main:
                metrics_log.append(row)
                reporter.metric(**row)
            if step % spec.checkpoint.every_n_steps == 0 and step < total_steps:
                checkpoint_now()

        # -- save: the final checkpoint, then the adapter, config and manifest -----------
        checkpoint_now()
        adapter = gather_adapter_state(model)
        if ctx.is_main:
            write_adapter(output_dir / ADAPTER_DIR, adapter)
            write_training_config(output_dir, spec)
            (output_dir / "data_stats.json").write_text(json.dumps(data.stats(), indent=2), encoding="utf-8")
            files = finalize_outputs(output_dir)
            reporter.artifacts(str(output_dir), files)
            reporter.event("training finished", data={"step": step, "train_loss": last.get("train_loss")})
        barrier(ctx)
        return RunResult(model=model, final_step=step, losses=losses, output_dir=output_dir)
    finally:
        # -- cleanup: leave the process group even on failure (ranks exit together) -----
        destroy_distributed()


def _agree_to_stop(requested: bool, ctx: DistContext) -> bool:
    """True on every rank if SIGTERM reached any of them (so all checkpoint one step)."""
    return all_reduce_sum([1.0 if requested else 0.0], ctx)[0] > 0


def _memory_bytes(ctx: DistContext) -> int:
    """Peak accelerator memory allocated, else the process's peak RSS (``VmHWM``)."""
    from trainers.common.memory import peak_rss_bytes

    if ctx.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(ctx.device))
    return peak_rss_bytes()
