"""The PyTorch (Q)LoRA recipe: one loop for 1 or N processes, quantized base or not.

Reads like the run it performs, on every rank:

    env -> checks -> data -> model (meta, quantize, LoRA, shard, stream weights) ->
    optimizer -> (resume) -> train loop -> export

QLoRA is this LoRA recipe with a quantized base; one process is this recipe with a
world of one (no process group, no FSDP wrapping). What is shared with the JAX trainer
lives in ``trainers.common`` (data pipeline, schedule, reporter, checkpoint layout,
PEFT exporter); what is specific is the model build (``loading.build_model``), the step
(``train_step.train_step``: global-token loss, ``no_sync`` accumulation, DTensor
clipping) and the checkpoint (DCP shards, ``checkpoint.py``).

The train loop does, per optimizer step: read ``batch_size / micro_batch_size``
micro-batches at the data cursor (each rank keeps its share), back-propagate each with
``sum(token losses) / label tokens of the whole step`` (so the update depends neither on
how the step is split into micro-batches nor on the world size), clip, AdamW-update the
LoRA parameters with the shared schedule's learning rate, report metrics, evaluate and
checkpoint on their cadence, and stop cleanly on SIGTERM (checkpoint, report,
``Preempted``). A resumed run reproduces the uninterrupted one: the checkpoint holds the
adapter, the AdamW state, the data cursor and the RNG states.

Processes. ``run`` is what ``python -m trainers`` calls. When the spec asks for
``world_size > 1`` and this process is not already a rank (no ``RANK`` in the
environment), it becomes a launcher: it spawns the ranks on this machine
(``distributed.launch_local``; on Kubernetes one pod per node does the same for its
GPUs using ``NNODES``/``NODE_RANK``), forwards SIGTERM to them, and relays rank 0's
report items into its own reporter, so the job keeps ONE reporter and one ``seq``
series. A failing rank's ``{code, message}`` becomes the launcher's error.

Only rank 0 reports, evaluates into metrics, and writes files; every rank runs every
forward (FSDP all-gathers are collectives). SIGTERM is agreed on by all ranks at each
step boundary (an all-reduce), so they checkpoint the same step.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainers.errors import OutOfMemory, Preempted, TrainerError, UserError
from trainers.exit_codes import ExitCode

RANK_REPORTS = ".rank0-reports.jsonl"
RANK_SPEC = ".launch-spec.json"
TERMINATION_FILE = ".rank{rank}-termination.json"


@dataclass
class RunResult:
    """What a finished run leaves in memory (used by tests; the entry point ignores it)."""

    model: nn.Module
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None


# ---- launcher (the process `python -m trainers` started) ---------------------------------


def run(spec: Any, *, reporter: Any, stop: Any) -> Any:
    """Entry used by ``trainers.__main__`` for ``trainer: fsdp_qlora``."""
    if spec.parallelism.world_size > 1 and "RANK" not in os.environ:
        return launch_ranks(spec, reporter=reporter, stop=stop)
    return run_rank(spec, reporter=reporter, stop=stop)


def launch_ranks(spec: Any, *, reporter: Any, stop: Any) -> None:
    """Spawn this node's ranks, relay rank 0's reports, and turn their exit into ours."""
    from trainers.fsdp_qlora.distributed import (
        accelerator_available,
        check_parallelism,
        launch_local,
    )

    par, hp = spec.parallelism, spec.hyperparameters
    # Refuse bad layouts here too, before N processes pay their imports.
    check_parallelism(world_size=par.world_size, batch_size=hp.batch_size, micro_batch_size=hp.micro_batch_size,
                      cpu_offload=par.cpu_offload, has_accelerator=accelerator_available())
    work = Path(spec.checkpoint.dir)
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / RANK_SPEC
    spec.dump(spec_path)
    reports = work / RANK_REPORTS
    reports.unlink(missing_ok=True)
    for old in work.glob(".rank*-termination.json"):
        old.unlink()
    nnodes = int(os.environ.get("NNODES", str(par.nodes)))
    argv = [sys.executable, "-m", "trainers.fsdp_qlora.recipe", "--spec", str(spec_path),
            "--work-dir", str(work)]
    relay = _ReportRelay(reports, reporter)
    relay.start()
    try:
        code = launch_local(argv, par.world_size, nnodes=nnodes)
    finally:
        relay.stop()
        spec_path.unlink(missing_ok=True)
    if code == 0:
        return
    raise _rank_error(work, code)


def _rank_error(work: Path, code: int) -> TrainerError:
    """The error of the first rank that wrote one (rank 0 first), else a generic one."""
    for path in sorted(work.glob(".rank*-termination.json")):
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cls = {int(ExitCode.USER_ERROR): UserError, int(ExitCode.OUT_OF_MEMORY): OutOfMemory,
               int(ExitCode.PREEMPTED): Preempted}.get(code, TrainerError)
        return cls(info.get("message", "a rank failed"), code=info.get("code"))
    if code == int(ExitCode.PREEMPTED):
        return Preempted("ranks stopped on SIGTERM")
    return TrainerError(f"a rank exited with code {code}", code="internal_error")


class _ReportRelay:
    """Tails rank 0's local report file and re-adds each item to the launcher's reporter."""

    def __init__(self, path: Path, reporter: Any, interval_s: float = 0.25) -> None:
        self.path, self.reporter, self.interval_s = path, reporter, interval_s
        self._offset = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="report-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._drain()

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            self._drain()

    def _drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):  # a partial line: read it next time
                    break
                self._offset += len(line.encode("utf-8"))
                item = json.loads(line)
                item.pop("seq", None)  # the launcher's reporter numbers its own batches
                self.reporter.add(item)


# ---- one rank --------------------------------------------------------------------------


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off, no grad, but quantized layers left in train mode: an eval-mode bnb
    Linear4bit repacks its weight in place on avx512_bf16 CPUs (FACTS.md), which under
    FSDP would corrupt the all-gathered copy's layout bookkeeping."""
    from trainers.fsdp_qlora.quantize import is_quantized_linear

    changed = [m for m in model.modules() if m.training and not is_quantized_linear(m)]
    for m in changed:
        m.training = False
    try:
        with torch.no_grad():
            yield
    finally:
        for m in changed:
            m.training = True


def evaluate(model: nn.Module, data: Any, ctx: Any, max_batches: int | None) -> dict[str, float]:
    """Mean token loss and accuracy on validation (every rank runs the same batches)."""
    from trainers.fsdp_qlora.train_step import IGNORE_INDEX, model_inputs

    loss_sum, correct, count = 0.0, 0, 0
    batches = data.micro_batches()
    with evaluation_mode(model):
        for _ in range(min(data.micro_batches_per_epoch(0), max_batches or 1 << 30)):
            batch = next(batches)
            logits = model(**model_inputs(batch, ctx.device)).logits[:, :-1].float()
            labels = torch.as_tensor(batch.labels[:, 1:], device=ctx.device)
            mask = labels != IGNORE_INDEX
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum"))
            correct += int(((logits.argmax(-1) == labels) & mask).sum())
            count += int(mask.sum())
    return {"valid_loss": loss_sum / max(count, 1), "token_accuracy": correct / max(count, 1)}


def _agree_to_stop(requested: bool, ctx: Any) -> bool:
    from trainers.fsdp_qlora.distributed import all_reduce_sum

    return all_reduce_sum([1.0 if requested else 0.0], ctx)[0] > 0


def resolve_resume(spec: Any) -> Path | None:
    """The checkpoint to resume from: None, the newest in ``checkpoint.dir`` ('latest'),
    or an explicit directory (UserError ``checkpoint_not_found`` if it is not one)."""
    from trainers.common.checkpointing import latest_checkpoint

    wanted = spec.checkpoint.resume_from
    if wanted is None:
        return None
    if wanted == "latest":
        return latest_checkpoint(spec.checkpoint.dir)
    path = Path(wanted)
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"no checkpoint at {wanted}", code="checkpoint_not_found")
    return path


def memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated, else the process's peak RSS (``VmHWM``)."""
    from trainers.common.memory import peak_rss_bytes

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def run_rank(spec: Any, *, reporter: Any, stop: Any) -> Any:
    """The training run of one rank (world_size 1 runs this directly)."""
    from trainers.common.checkpointing import (
        TrainerState,
        capture_host_rng,
        load_trainer_state,
        restore_host_rng,
    )
    from trainers.common.data import DataCursor
    from trainers.common.job_data import (
        check_inputs_exist,
        load_job_data,
        load_tokenizer,
        total_optimizer_steps,
    )
    from trainers.common.outputs import (
        ADAPTER_DIR,
        MetricsLog,
        finalize_outputs,
        write_training_config,
    )
    from trainers.common.peft_export import write_peft_adapter
    from trainers.common.schedules import learning_rate_at
    from trainers.fsdp_qlora.checkpoint import (
        gather_adapter_state,
        load_sharded,
        peft_weights,
        save_checkpoint_distributed,
    )
    from trainers.fsdp_qlora.distributed import (
        accelerator_available,
        barrier,
        check_parallelism,
        destroy_distributed,
        init_distributed,
    )
    from trainers.fsdp_qlora.loading import build_model, options_from_spec
    from trainers.fsdp_qlora.train_step import build_optimizer, rank_share, train_step

    # -- setup: layout checks before anything heavy ---------------------------------------
    hp, par, a = spec.hyperparameters, spec.parallelism, spec.adapter
    check_parallelism(world_size=par.world_size, batch_size=hp.batch_size, micro_batch_size=hp.micro_batch_size,
                      cpu_offload=par.cpu_offload, has_accelerator=accelerator_available())
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
                                                    "device": str(ctx.device), "quantization": a.quantization})

        # -- data (every rank reads the same global order; each keeps its share) ----------
        tokenizer = load_tokenizer(spec.model.path)
        data = load_job_data(spec, tokenizer)
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
        optimizer = build_optimizer(model, learning_rate=hp.learning_rate, weight_decay=hp.weight_decay)

        # -- resume -----------------------------------------------------------------------
        step, cursor, tokens_seen = 0, DataCursor(), 0
        last: dict[str, float | None] = {"train_loss": None, "valid_loss": None, "token_accuracy": None}
        resume_path = resolve_resume(spec)
        if resume_path is not None:
            load_sharded(resume_path, model, optimizer, ctx)
            state = load_trainer_state(resume_path)
            restore_host_rng(state.rng)
            step, cursor = state.step, state.cursor
            tokens_seen = int(state.extra.get("tokens_seen", 0))
            last.update(state.metrics)
            if ctx.is_main:
                reporter.event(f"resumed from {resume_path.name}", data={"step": step, "cursor": cursor.to_dict()})
        metrics_log = MetricsLog(output_dir, resume_step=step if resume_path is not None else None) if ctx.is_main else None
        batches = data.train.micro_batches(cursor)
        # Without FSDP there is no mixed-precision policy: autocast does the casting.
        autocast = (
            torch.autocast(ctx.device.type, dtype=getattr(torch, spec.precision.compute_dtype))
            if not ctx.distributed and spec.precision.compute_dtype != spec.precision.base_dtype
            else nullcontext()
        )

        def checkpoint_now() -> Path:
            adapter = gather_adapter_state(model)  # collective: every rank

            def write_adapter(d: Path) -> None:
                write_peft_adapter(d, peft_weights(adapter), r=a.r, alpha=a.alpha, dropout=a.dropout,
                                   target_modules=a.target_modules, base_model_name_or_path=spec.model.path)

            state = TrainerState(step=step, epoch=cursor.epoch, cursor=cursor, rng=capture_host_rng(),
                                 metrics=dict(last), extra={"tokens_seen": tokens_seen,
                                                            "world_size": ctx.world_size})
            path = save_checkpoint_distributed(spec.checkpoint.dir, state, model, optimizer, ctx,
                                               keep_last=spec.checkpoint.keep_last, write_adapter=write_adapter)
            if ctx.is_main:
                reporter.checkpoint(step, str(path), dict(last))
            return path

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
                stats = train_step(model, optimizer, rank_share(micro, ctx), ctx, step=step, seed=spec.seed,
                                   learning_rate=lr, max_grad_norm=hp.max_grad_norm)
            if not (np.isfinite(stats.loss) and np.isfinite(stats.grad_norm)):
                raise UserError(f"the loss is {stats.loss} (grad norm {stats.grad_norm}) at step {step + 1}; "
                                "lower the learning rate or check the model and data", code="nan_loss")
            step += 1
            cursor = micro[-1].cursor_after
            tokens_seen += stats.tokens
            elapsed = time.perf_counter() - started
            losses[step] = stats.loss
            last["train_loss"] = stats.loss
            row: dict[str, Any] = {
                "step": step, "total_steps": total_steps,
                "epoch": cursor.epoch if cursor.position else cursor.epoch - 1,
                "train_loss": stats.loss, "learning_rate": lr, "grad_norm": stats.grad_norm,
                "tokens_per_s": stats.tokens / elapsed if elapsed > 0 else None, "tokens_seen": tokens_seen,
                "memory_bytes": memory_bytes(ctx.device), "valid_loss": None, "token_accuracy": None,
            }
            if data.validation is not None and spec.eval.every_n_steps and (
                step % spec.eval.every_n_steps == 0 or step == total_steps
            ):
                row.update(evaluate(model, data.validation, ctx, spec.eval.max_batches))
                last.update(valid_loss=row["valid_loss"], token_accuracy=row["token_accuracy"])
            if ctx.is_main:
                metrics_log.append({**row, "time": time.time()})
                reporter.metric(**row)
            if step % spec.checkpoint.every_n_steps == 0 and step < total_steps:
                checkpoint_now()

        # -- export -------------------------------------------------------------------------
        checkpoint_now()
        adapter = gather_adapter_state(model)
        if ctx.is_main:
            write_peft_adapter(output_dir / ADAPTER_DIR, peft_weights(adapter), r=a.r, alpha=a.alpha,
                               dropout=a.dropout, target_modules=a.target_modules,
                               base_model_name_or_path=spec.model.path)
            write_training_config(output_dir, spec)
            (output_dir / "data_stats.json").write_text(json.dumps(data.stats(), indent=2), encoding="utf-8")
            files = finalize_outputs(output_dir)
            reporter.artifacts(str(output_dir), files)
            reporter.event("training finished", data={"step": step, "train_loss": last["train_loss"]})
        barrier(ctx)
        return RunResult(model=model, final_step=step, losses=losses, output_dir=output_dir)
    finally:
        destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """One rank started by :func:`launch_ranks`: ``--spec`` and the launcher's work dir."""
    import argparse

    from trainers.__main__ import classify
    from trainers.common.reporter import Reporter
    from trainers.common.signals import StopFlag
    from trainers.spec import TrainerSpec

    parser = argparse.ArgumentParser(prog="python -m trainers.fsdp_qlora.recipe")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    spec = TrainerSpec.load(args.spec)
    rank = int(os.environ.get("RANK", "0"))
    work = Path(args.work_dir)
    # Rank 0 writes items locally; the launcher relays them into the job's one reporter.
    reporter = Reporter(url=None, local_path=work / RANK_REPORTS if rank == 0 else os.devnull,
                        flush_interval_s=0.2)
    stop = StopFlag().install()
    code = 0
    try:
        run_rank(spec, reporter=reporter, stop=stop)
    except BaseException as exc:  # every outcome becomes an exit code  # noqa: BLE001
        error = classify(Preempted("interrupted") if isinstance(exc, KeyboardInterrupt) else exc)
        if error.exit_code == ExitCode.INTERNAL_ERROR:
            import traceback

            traceback.print_exception(exc)
        (work / TERMINATION_FILE.format(rank=rank)).write_text(json.dumps(error.to_dict()), encoding="utf-8")
        code = int(error.exit_code)
    finally:
        stop.uninstall()
        reporter.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
