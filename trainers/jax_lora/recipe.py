"""The JAX LoRA recipe: ``run(spec)`` trains a LoRA adapter on a Llama checkpoint.

Read top to bottom: setup (multi-host, config, mesh, checks that need no compile),
data, model, adapter + optimizer (sharded), resume, the loop (step, metrics, eval,
checkpoint, preemption), export. Reusable parts live in the sibling modules; data,
reporting, checkpoint layout and resume rule, schedules, the loop's decisions (eval
cadence, epoch numbering, NaN policy, metric row: ``trainers.common.loop``), the HF
checkpoint index and PEFT export are shared with the torch trainer through
``trainers.common``.

Batch layout. ``micro_batch_size`` is per data-parallel rank; the data-parallel size is
``mesh.data * mesh.fsdp``. One optimizer step consumes ``batch_size / micro_batch_size``
micro-batches from the shared loader, arranged as (accum, dp * micro_batch_size, seq),
so the global batch is exactly ``batch_size`` rows whatever the mesh (a DPO job: pairs,
each micro-batch ``dp`` blocks of chosen-then-rejected rows). Shapes are fixed
(rows padded to ``max_seq_len``; a short last micro-batch of an epoch gets all-padding
rows) so the step compiles once.

CPU-only hosts. ``parallelism.host_devices`` (set by the worker for local CPU pools) splits
the host into that many XLA devices before JAX starts (``host_devices.py``); the mesh
then spans them like any other devices.

Multi-host. Every process reads and tokenizes the (small) JSONL files and builds the same
global token-id batch on the host; ``jax.make_array_from_callback`` then hands each
process's devices only their rows. Only process 0 reports, writes checkpoints and
exports.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainers.common.checkpointing import (
    TrainerState,
    capture_host_rng,
    load_trainer_state,
    report_resumed,
    resolve_resume,
    restore_host_rng,
    save_checkpoint,
)
from trainers.common.data import IGNORE_INDEX, Batch, DataCursor, TrainingData
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
from trainers.common.outputs import (
    ADAPTER_DIR,
    MetricsLog,
    finalize_outputs,
    finish_adapter,
    write_training_config,
)
from trainers.common.preference import PreferenceData, RewardSums, load_training_data, pad_pairs
from trainers.common.reporter import Reporter, reporter_from_spec
from trainers.common.signals import StopFlag
from trainers.errors import Preempted, UserError
from trainers.spec import TrainerSpec, trains_base

LOCAL_REPORTS = "reports.jsonl"


def _check_spec(spec: TrainerSpec) -> None:
    if spec.trainer != "jax_lora":
        raise UserError(f"spec.trainer is {spec.trainer!r}, this is the jax_lora trainer", code="invalid_spec")
    if not trains_base("jax_lora", spec.adapter.quantization, spec.adapter.double_quant):
        raise UserError(
            "the JAX trainer's 4-bit base is NF4 without double quantization; hqq4 and "
            "double_quant run on the fsdp_qlora trainer",
            code="invalid_spec",
        )
    if spec.adapter.use_dora:
        raise UserError("DoRA is not supported by the JAX trainer", code="invalid_spec")
    if spec.parallelism.cpu_offload:
        raise UserError("cpu_offload is not supported by the JAX trainer", code="invalid_spec")


def _data_parallel_plan(spec: TrainerSpec) -> tuple[int, int]:
    """(data-parallel size, micro-batches accumulated per step); UserError if they don't divide."""
    hp, mesh = spec.hyperparameters, spec.parallelism.mesh
    dp = mesh.data * mesh.fsdp
    rows = hp.micro_batch_size * dp
    if hp.batch_size % rows:
        raise UserError(
            f"hyperparameters.batch_size ({hp.batch_size}) must be a multiple of micro_batch_size "
            f"({hp.micro_batch_size}) x data-parallel size (mesh.data x mesh.fsdp = {dp})",
            code="invalid_parallelism",
        )
    return dp, hp.batch_size // rows


class StepLayout(NamedTuple):
    """Where a job's step lives: its mesh, batch plan, and the abstract base and LoRA
    arrays with their shardings (built from the spec alone: nothing allocated)."""

    mesh: Any
    data_parallel: int
    accumulation: int
    targets: tuple[str, ...]
    quantization: str
    param_shapes: Any
    param_shardings: Any
    lora_shapes: Any
    lora_shardings: Any


def step_layout(spec: TrainerSpec, cfg: Any, devices: list[Any] | None = None) -> StepLayout:
    """The mesh over ``devices`` (default all) and every abstract array's sharding for ``spec``.

    The recipe and ``bench/plan_aot.py`` (which compiles this step without weights) both
    build the layout here, so a plan cannot drift from a run.

    Raises:
        UserError: heads that do not divide the tensor axis, a batch that does not divide
            the data-parallel size, unknown target modules.
    """
    import jax.numpy as jnp

    from trainers.jax_lora.lora import lora_axes, lora_shapes, validate_targets
    from trainers.jax_lora.model import param_axes, param_shapes
    from trainers.jax_lora.sharding import check_divisible_heads, make_mesh, tree_shardings

    m = spec.parallelism.mesh
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
    check_divisible_heads(cfg.num_heads, cfg.num_kv_heads, mesh)
    dp, accum = _data_parallel_plan(spec)
    targets = validate_targets(spec.adapter.target_modules)
    quantization = spec.adapter.quantization
    p_abstract = param_shapes(cfg, jnp.dtype(spec.precision.base_dtype), quantization)
    l_abstract = lora_shapes(cfg, targets, spec.adapter.r, jnp.dtype(spec.precision.adapter_dtype))
    return StepLayout(
        mesh=mesh, data_parallel=dp, accumulation=accum, targets=targets, quantization=quantization,
        param_shapes=p_abstract, param_shardings=tree_shardings(p_abstract, param_axes(cfg, quantization), mesh),
        lora_shapes=l_abstract, lora_shardings=tree_shardings(l_abstract, lora_axes(targets), mesh),
    )


def _pad_rows(batch: Batch, rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """Arrays of exactly ``rows`` rows; extra rows are padding (no tokens trained)."""
    n, length = batch.input_ids.shape
    out = {
        "input_ids": batch.input_ids,
        "labels": batch.labels,
        "positions": batch.position_ids,
        "segment_ids": batch.segment_ids,
    }
    if n < rows:
        extra = rows - n
        fill = {
            "input_ids": np.full((extra, length), pad_id),
            "labels": np.full((extra, length), IGNORE_INDEX),
            "positions": np.broadcast_to(np.arange(length), (extra, length)),
            "segment_ids": np.zeros((extra, length)),
        }
        out = {k: np.concatenate([v, fill[k]]) for k, v in out.items()}
    return {k: np.asarray(v, dtype=np.int32) for k, v in out.items()}


def _block(data: TrainingData, batch: Batch, pad_id: int) -> dict[str, np.ndarray]:
    """One data-parallel block of a step, padded to its fixed row count: ``micro_batch_size``
    rows, or for preference data that many pairs (chosen rows, then rejected rows)."""
    micro = data.micro_batch_size
    if isinstance(data, PreferenceData):
        return _pad_rows(pad_pairs(batch, micro, pad_id), 2 * micro, pad_id)
    return _pad_rows(batch, micro, pad_id)


def _step_batches(data: TrainingData, start: DataCursor, dp: int, accum: int, pad_id: int) -> Iterator[tuple[dict[str, np.ndarray], DataCursor]]:
    """Global (accum, dp * micro, seq) host batches and the cursor after each (preference
    data: (accum, dp * 2 * micro, seq), dp blocks of chosen-then-rejected rows)."""
    stream = data.micro_batches(start)
    while True:
        groups = []
        cursor = start
        for _ in range(accum):
            parts = []
            for _ in range(dp):
                b = next(stream)
                parts.append(_block(data, b, pad_id))
                cursor = b.cursor_after
            groups.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        yield {k: np.stack([g[k] for g in groups]) for k in groups[0]}, cursor


def _eval_batches(data: TrainingData, dp: int, pad_id: int, max_batches: int | None) -> Iterator[dict[str, np.ndarray]]:
    """One pass over the validation rows, dp micro-batches per global eval batch."""
    rows = data.rows(0)
    micro = data.micro_batch_size
    per = micro * dp
    n_batches = math.ceil(len(rows) / per)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for i in range(n_batches):
        if not isinstance(data, PreferenceData):
            yield _pad_rows(data.collate(rows[i * per : (i + 1) * per]), per, pad_id)
            continue
        # dp blocks of pairs; a block past the last pair is all padding
        chunks = [rows[i * per + d * micro : i * per + (d + 1) * micro] for d in range(dp)]
        blocks = [_block(data, data.collate(c), pad_id) if c else _padding_block(data, pad_id) for c in chunks]
        yield {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def _padding_block(data: TrainingData, pad_id: int) -> dict[str, np.ndarray]:
    empty = np.zeros((0, data.pad_to or data.max_seq_len), dtype=np.int64)
    return _block(data, Batch(empty, empty, empty, empty, empty), pad_id)


def run(
    spec: TrainerSpec,
    *,
    reporter: Reporter | None = None,
    stop: StopFlag | None = None,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Train and export the adapter described by ``spec``.

    Args:
        reporter: where reports go (the entry point passes one); None = a standalone
            reporter built from ``spec.report``, closed on return. Only process 0 uses it.
        stop: the SIGTERM flag (the entry point installs one); checked between steps.
        on_step: called with the step number after each optimizer step (tests use it to
            request a stop at a precise step).

    Raises:
        UserError, Preempted, OutOfMemory: see ``trainers.errors``.
    """
    # -- setup: everything that can be refused without compiling anything -------------
    _check_spec(spec)
    from trainers.jax_lora.distributed import initialize_from_env
    from trainers.jax_lora.host_devices import use_host_devices

    use_host_devices(spec.parallelism.host_devices)  # before anything touches a device
    initialize_from_env()

    import jax
    import jax.numpy as jnp

    from trainers.common.memory import peak_rss_bytes
    from trainers.jax_lora import checkpoint as ckpt
    from trainers.jax_lora.config import LlamaConfig
    from trainers.jax_lora.export import export_adapter
    from trainers.jax_lora.loading import load_params
    from trainers.jax_lora.lora import init_lora, lora_runtime
    from trainers.jax_lora.sharding import check_replication, sharding_report
    from trainers.jax_lora.step import (
        PreferenceLoss,
        StepConfig,
        batch_sharding,
        compile_steps,
        init_state,
        make_optimizer,
        make_schedule,
        state_shardings,
    )

    stop = stop or StopFlag()
    primary = jax.process_index() == 0
    check_inputs_exist(spec)
    cfg = LlamaConfig.from_pretrained(spec.model.path)
    m = spec.parallelism.mesh
    layout = step_layout(spec, cfg)
    mesh, dp, accum, targets, quantization = (layout.mesh, layout.data_parallel, layout.accumulation,
                                               layout.targets, layout.quantization)
    base_dtype = jnp.dtype(spec.precision.base_dtype)
    adapter_dtype = jnp.dtype(spec.precision.adapter_dtype)
    p_abstract, p_shard = layout.param_shapes, layout.param_shardings
    p_report = sharding_report(p_abstract, p_shard, mesh)
    check_replication(p_report, what="base parameters")
    l_abstract, l_shard = layout.lora_shapes, layout.lora_shardings

    ckpt_root = Path(spec.checkpoint.dir)
    out_dir = Path(spec.output_dir)
    resume_from = resolve_resume(spec.checkpoint)
    resume_state = load_trainer_state(resume_from) if resume_from is not None else None
    own_reporter = reporter is None and primary
    if own_reporter:
        reporter = reporter_from_spec(
            spec.report, default_spool_dir=ckpt_root / ".report-spool", local_path=ckpt_root / LOCAL_REPORTS
        )
    try:
        # -- data ------------------------------------------------------------------------
        tokenizer = load_tokenizer(spec.model.path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        dpo = spec.method.type == "dpo"
        data = load_training_data(spec, tokenizer, pad_to=spec.data.max_seq_len)
        total_steps = total_optimizer_steps(spec, data.train, dp)

        # -- model: tensor by tensor into sharded arrays ---------------------------------
        t0 = time.perf_counter()
        params, load_stats = load_params(spec.model.path, cfg, mesh, base_dtype, quantization)
        load_s = time.perf_counter() - t0

        # -- adapter + optimizer, created directly sharded ---------------------------------
        hp = spec.hyperparameters
        schedule = make_schedule(
            hp.lr_scheduler, base_lr=hp.learning_rate, total_steps=total_steps, warmup_steps=hp.warmup_steps
        )
        optimizer = make_optimizer(schedule, weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm)
        shardings = state_shardings(l_shard, optimizer, l_abstract, mesh)
        root_key = jax.random.key(spec.seed)
        lora = jax.jit(
            lambda k: init_lora(cfg, targets, spec.adapter.r, k, adapter_dtype), out_shardings=l_shard
        )(jax.random.fold_in(root_key, 0))
        state = init_state(lora, optimizer, shardings, jax.random.fold_in(root_key, 1))
        opt_report = sharding_report(state["opt_state"], shardings["opt_state"], mesh)

        # -- resume ----------------------------------------------------------------------
        step, cursor, tokens_seen = 0, DataCursor(), 0
        metrics_log = MetricsLog(out_dir, resume_step=resume_state.step if resume_state else None) if primary else None
        if resume_state is not None:
            state = ckpt.restore_state(resume_from, state, shardings)
            step, cursor = resume_state.step, resume_state.cursor
            tokens_seen = int(resume_state.extra.get("tokens_seen", 0))
            restore_host_rng(resume_state.rng)
            if int(state["step"]) != step:
                raise UserError(f"checkpoint {resume_from} is inconsistent (step mismatch)", code="incompatible_checkpoint")
            if primary:
                report_resumed(reporter, ckpt_root, resume_from, resume_state, metrics_log.rows(),
                               every_n_steps=spec.checkpoint.every_n_steps)

        sc = StepConfig(
            cfg=cfg,
            runtime=lora_runtime(spec.adapter.alpha, spec.adapter.r, spec.adapter.dropout),
            remat=spec.parallelism.remat,
            compute_dtype=spec.precision.compute_dtype,
            packed=spec.data.packing,
            # DPO: dp blocks of chosen-then-rejected rows per micro-batch (_step_batches)
            preference=PreferenceLoss(spec.method.beta, spec.method.sft_weight, blocks=dp) if dpo else None,
        )
        train_step, eval_step = compile_steps(sc, optimizer, mesh, shardings, p_shard)

        def to_device(host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
            # Each process materializes only the slices its own devices hold.
            return {
                k: jax.make_array_from_callback(v.shape, batch_sharding(mesh, v.shape), lambda idx, v=v: v[idx])
                for k, v in host.items()
            }

        def evaluate_preference() -> dict[str, float]:
            sums, chosen_nll, chosen_tokens = RewardSums(), 0.0, 0.0
            for host in _eval_batches(data.validation, dp, pad_id, spec.eval.max_batches):
                out = {k: float(v) for k, v in eval_step(state["lora"], params, to_device(host)).items()}
                sums = sums + _reward_sums(out)
                chosen_nll += out["chosen_nll"]
                chosen_tokens += out["chosen_tokens"]
            value = sums.loss / max(sums.pairs, 1.0) + spec.method.sft_weight * chosen_nll / max(chosen_tokens, 1.0)
            return {"valid_loss": value, "token_accuracy": None, **sums.metrics("valid_")}

        def evaluate() -> dict[str, float]:
            if dpo:
                return evaluate_preference()
            nll = n_tok = n_ok = 0.0
            for host in _eval_batches(data.validation, dp, pad_id, spec.eval.max_batches):
                out = eval_step(state["lora"], params, to_device(host))
                nll += float(out["nll_sum"])
                n_tok += float(out["n_tokens"])
                n_ok += float(out["n_correct"])
            return {"valid_loss": nll / max(n_tok, 1.0), "token_accuracy": n_ok / max(n_tok, 1.0)}

        def checkpoint(last_metrics: dict[str, Any]) -> Path | None:
            host_state = ckpt.state_to_host(state)  # every process joins the gathers
            if not primary:
                return None

            def write_tensors(d: Path) -> None:
                from safetensors.numpy import save_file

                save_file(host_state, str(d / ckpt.STATE_FILE))
                export_adapter(
                    d / ADAPTER_DIR, _lora_from_flat(host_state), r=spec.adapter.r, alpha=spec.adapter.alpha,
                    dropout=spec.adapter.dropout, target_modules=targets, base_model_name_or_path=spec.model.path,
                )
                finish_adapter(d / ADAPTER_DIR, spec)

            ts = TrainerState(
                step=step, epoch=epoch_of_step(cursor), cursor=cursor, rng=capture_host_rng(),
                metrics=last_metrics,
                extra={"trainer": "jax_lora", "seed": spec.seed, "tokens_seen": tokens_seen},
            )
            # Its metrics are spooled before the rename, its listing right after it.
            return save_checkpoint(ckpt_root, ts, write_tensors, keep_last=spec.checkpoint.keep_last,
                                   reporter=reporter)

        if primary:
            write_training_config(out_dir, spec)
            reporter.event(
                "jax_lora: model loaded" + (f", resuming at step {step}" if step else ""),
                data={
                    "devices": jax.device_count(), "processes": jax.process_count(),
                    "mesh": {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor},
                    "base_quantization": quantization, "param_bytes_per_device": p_report.bytes_per_device,
                    "optimizer_bytes_per_device": opt_report.bytes_per_device,
                    "host_peak_rss_bytes_after_load": load_stats["host_peak_rss_bytes"],
                    "load_seconds": round(load_s, 3), "total_steps": total_steps,
                    "grad_accumulation": accum, **data.stats(),
                },
            )

        # -- the loop --------------------------------------------------------------------
        batches = _step_batches(data.train, cursor, dp, accum, pad_id)
        last: dict[str, Any] = dict(resume_state.metrics) if resume_state is not None else {}
        while step < total_steps:
            host_batch, next_cursor = next(batches)
            t_step = time.perf_counter()
            state, out = train_step(state, params, to_device(host_batch))
            loss = float(out["loss"])  # blocks: the step's time below is real
            elapsed = time.perf_counter() - t_step
            grad_norm = float(out["grad_norm"])
            check_finite(step + 1, loss, grad_norm)
            lr = float(schedule(step))
            step, cursor = step + 1, next_cursor
            n_tokens = int((host_batch["segment_ids"] > 0).sum())
            tokens_seen += n_tokens
            evaluated = None
            if should_evaluate(step, total_steps=total_steps, every_n_steps=spec.eval.every_n_steps,
                               has_validation=data.validation is not None):
                evaluated = evaluate()
            row = metric_row(
                step=step, total_steps=total_steps, cursor_after=cursor, train_loss=loss, learning_rate=lr,
                grad_norm=grad_norm, step_tokens=n_tokens, elapsed_s=elapsed, tokens_seen=tokens_seen,
                memory_bytes=_device_memory_bytes(jax) or peak_rss_bytes(), evaluation=evaluated,
                rewards=_reward_sums({k: float(v) for k, v in out.items()}).metrics() if dpo else None,
            )
            last = checkpoint_metrics(row, last)
            if primary:
                reporter.metric(**row)
                metrics_log.append(row)
            if on_step is not None:
                on_step(step)
            if stop.requested or step % spec.checkpoint.every_n_steps == 0:
                checkpoint(last)
            if stop.requested:
                if primary:
                    reporter.event(f"preempted ({stop.signal_name}) at step {step}; checkpoint written")
                raise Preempted(f"stopped by {stop.signal_name} at step {step}; resume from the checkpoint")

        # -- export ----------------------------------------------------------------------
        if step % spec.checkpoint.every_n_steps:
            checkpoint(last)
        host_state = ckpt.state_to_host(state)
        if primary:
            export_adapter(
                out_dir / ADAPTER_DIR, _lora_from_flat(host_state), r=spec.adapter.r, alpha=spec.adapter.alpha,
                dropout=spec.adapter.dropout, target_modules=targets, base_model_name_or_path=spec.model.path,
            )
            finish_adapter(out_dir / ADAPTER_DIR, spec)
            files = finalize_outputs(out_dir)
            reporter.artifacts(str(out_dir), files)
            reporter.event(f"training finished after {step} steps; adapter exported")
    finally:
        if own_reporter:
            reporter.close()


def _reward_sums(out: dict[str, float]) -> RewardSums:
    """A DPO step's (or eval batch's) reward sums from the compiled step's outputs."""
    return RewardSums(pairs=out["pairs"], loss=out["loss_sum"], chosen=out["chosen_sum"],
                      rejected=out["rejected_sum"], correct=out["correct"])


def _lora_from_flat(flat: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``lora/<module>/<a|b>`` entries of a flat host state back into the LoRA pytree."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        parts = key.split("/")
        if parts[0] == "lora":
            out.setdefault(parts[1], {})[parts[2]] = value
    return out


def _device_memory_bytes(jax_module: Any) -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPUs)."""
    try:
        stats = jax_module.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends raise or return None; that is "unknown"
        return None
    if not stats:
        return None
    return int(stats.get("peak_bytes_in_use") or stats.get("bytes_in_use") or 0) or None
