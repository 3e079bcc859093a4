"""The JAX LoRA recipe: :class:`JaxLoraRecipe` trains a LoRA adapter on a decoder checkpoint.

Read top to bottom: setup (multi-host, config, mesh, checks that need no compile),
data, model, adapter + optimizer (sharded), resume; then the hooks of the common loop
(step, eval, checkpoint, adapter export). The loop itself (metrics, eval cadence,
checkpoints, preemption, outputs) is ``trainers.common.recipe``'s, with the decisions of
``trainers.common.loop``. Reusable parts live in the sibling modules; data, reporting,
checkpoint layout and resume rule, schedules, the HF checkpoint index and PEFT export
are shared with the torch trainer through ``trainers.common``.

Batch layout. ``micro_batch_size`` is per data-parallel rank; the data-parallel size is
``mesh.data * mesh.fsdp``. One optimizer step consumes ``batch_size / micro_batch_size``
micro-batches from the shared loader, arranged as (accum, dp * micro_batch_size, seq),
so the global batch is exactly ``batch_size`` rows whatever the mesh (a DPO job: pairs,
each micro-batch ``dp`` blocks of chosen-then-rejected rows). Shapes are fixed
(rows padded to ``max_seq_len``; a short last micro-batch of an epoch gets all-padding
rows) so the step compiles once.

Reinforcement fine-tuning (``method.type`` reinforcement, GRPO). A step reads
``batch_size`` prompts at the cursor, samples ``samples_per_prompt`` completions of each
from the current policy with a jitted KV-cache decode loop on the same mesh
(``sampling.py``), grades them and takes one update on GRPO's loss (``grpo.py``); an
evaluation samples the validation prompts and reports their mean reward. Grading,
advantages, metrics and the draws' seed are ``trainers.common.reinforcement``'s, as on
the torch trainer. The shapes are fixed when the job starts (the job's longest prompt and
largest token budget, ``batch_size x samples_per_prompt`` rows), so the decode loop and
the step each compile once.

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
from trainers.common.lineage import LoraWeights, read_parent_adapters, write_job_adapter
from trainers.common.loop import epoch_of_step
from trainers.common.outputs import ADAPTER_DIR, MetricsLog
from trainers.common.preference import PreferenceData, RewardSums, load_training_data, pad_pairs
from trainers.common.recipe import Progress, SteppedRecipe, StepResult, TrainResult, run_recipe
from trainers.common.reinforcement import (
    GrpoObjective,
    evaluation_metrics,
    group_advantages,
    grpo_objective,
    load_reinforcement_data,
    sampling_seed,
    step_metrics,
)
from trainers.common.reporter import Reporter
from trainers.common.signals import StopFlag
from trainers.errors import OutOfMemory, UserError
from trainers.spec import TrainerSpec, trains_base


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


def step_layout(spec: TrainerSpec, cfg: Any, devices: list[Any] | None = None,
                parent: LoraWeights | None = None) -> StepLayout:
    """The mesh over ``devices`` (default all) and every abstract array's sharding for ``spec``;
    with ``parent`` (the frozen adapter of the fine-tuned model the job continues) the base
    weights hold it too.

    The recipe and ``bench/plan_aot.py`` (which compiles this step without weights) both
    build the layout here, so a plan cannot drift from a run.

    Raises:
        UserError: heads that do not divide the tensor axis, a batch that does not divide
            the data-parallel size, unknown target modules.
    """
    import jax.numpy as jnp

    from trainers.jax_lora.lora import lora_axes, lora_shapes, validate_targets, with_parent_lora
    from trainers.jax_lora.model import param_axes, param_shapes
    from trainers.jax_lora.sharding import check_divisible_heads, make_mesh, tree_shardings

    m = spec.parallelism.mesh
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
    check_divisible_heads(cfg.num_heads, cfg.num_kv_heads, mesh)
    dp, accum = _data_parallel_plan(spec)
    targets = validate_targets(spec.adapter.target_modules)
    quantization = spec.adapter.quantization
    p_abstract = param_shapes(cfg, jnp.dtype(spec.precision.base_dtype), quantization)
    p_axes = param_axes(cfg, quantization)
    adapter_dtype = jnp.dtype(spec.precision.adapter_dtype)
    if parent is not None:
        p_abstract = with_parent_lora(p_abstract, lora_shapes(cfg, parent.target_modules, parent.r, adapter_dtype))
        p_axes = with_parent_lora(p_axes, lora_axes(parent.target_modules))
    l_abstract = lora_shapes(cfg, targets, spec.adapter.r, adapter_dtype)
    return StepLayout(
        mesh=mesh, data_parallel=dp, accumulation=accum, targets=targets, quantization=quantization,
        param_shapes=p_abstract, param_shardings=tree_shardings(p_abstract, p_axes, mesh),
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


def _step_batches(
    data: TrainingData, start: DataCursor, dp: int, accum: int, pad_id: int
) -> Iterator[tuple[dict[str, np.ndarray], DataCursor]]:
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


class JaxLoraRecipe(SteppedRecipe):
    """The JAX LoRA recipe (:class:`~trainers.common.recipe.Recipe`): :meth:`setup` builds
    the mesh, data, sharded model, adapter and optimizer (and resumes); the loop, the
    stop and output contracts are ``trainers.common.recipe``'s. Only process 0 reports,
    writes checkpoints and exports."""

    objective: GrpoObjective | None = None  # set by setup() for a reinforcement job

    def setup(self, spec: TrainerSpec, reporter: Reporter, stop: StopFlag) -> None:
        # -- setup: everything that can be refused without compiling anything -------------
        _check_spec(spec)
        from trainers.jax_lora.distributed import initialize_from_env
        from trainers.jax_lora.host_devices import use_host_devices

        use_host_devices(spec.parallelism.host_devices)  # before anything touches a device
        initialize_from_env()

        import jax
        import jax.numpy as jnp

        from trainers.jax_lora import checkpoint as ckpt
        from trainers.jax_lora.config import DecoderConfig
        from trainers.jax_lora.grpo import placeholder_batch, reinforcement_loss
        from trainers.jax_lora.loading import load_params
        from trainers.jax_lora.lora import init_lora, lora_runtime, parent_lora, with_parent_lora
        from trainers.jax_lora.model import PARENT_LORA
        from trainers.jax_lora.sampling import DecodeConfig, Sampler
        from trainers.jax_lora.sharding import check_replication, sharding_report
        from trainers.jax_lora.step import (
            PreferenceLoss,
            StepConfig,
            compile_steps,
            init_state,
            make_optimizer,
            make_schedule,
            state_shardings,
        )
        from trainers.jax_lora.step_fit import (
            StepFit,
            device_limit_bytes,
            fallback_steps,
            with_step,
            xla_step_bytes,
        )

        self.spec, self.reporter, self.stop = spec, reporter, stop
        self.primary = primary = jax.process_index() == 0
        check_inputs_exist(spec)
        cfg = DecoderConfig.from_pretrained(spec.model.path)
        m = spec.parallelism.mesh
        # A job that continues a fine-tuned model: its adapter, frozen, among the base weights.
        self.parent = parent = read_parent_adapters(spec)
        layout = step_layout(spec, cfg, parent=parent)
        self.mesh, self.dp, accum, self.targets = layout.mesh, layout.data_parallel, layout.accumulation, layout.targets
        mesh, dp, targets, quantization = self.mesh, self.dp, self.targets, layout.quantization
        base_dtype = jnp.dtype(spec.precision.base_dtype)
        adapter_dtype = jnp.dtype(spec.precision.adapter_dtype)
        p_abstract, p_shard = layout.param_shapes, layout.param_shardings
        p_report = sharding_report(p_abstract, p_shard, mesh)
        check_replication(p_report, what="base parameters")
        l_abstract, l_shard = layout.lora_shapes, layout.lora_shardings

        self.ckpt_root = ckpt_root = Path(spec.checkpoint.dir)
        self.output_dir = Path(spec.output_dir)
        resume_from = resolve_resume(spec.checkpoint)
        resume_state = load_trainer_state(resume_from) if resume_from is not None else None

        # -- data ------------------------------------------------------------------------
        tokenizer = load_tokenizer(spec.model.path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.dpo = dpo = spec.method.type == "dpo"
        # Reinforcement reads prompts: a step is batch_size prompts, sampled and graded.
        self.objective = objective = grpo_objective(spec, tokenizer) if spec.method.type == "reinforcement" else None
        self.data = data = self._load_data(spec, tokenizer)
        self.has_validation = data.validation is not None
        self.total_steps = total_steps = total_optimizer_steps(spec, data.train, dp)

        # -- model: tensor by tensor into sharded arrays ---------------------------------
        t0 = time.perf_counter()
        self.params, load_stats = load_params(spec.model.path, cfg, mesh, base_dtype, quantization)
        if parent is not None:
            host = parent_lora(cfg, parent, adapter_dtype)
            self.params = with_parent_lora(self.params, jax.tree.map(
                lambda v, s: jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx]),
                host, p_shard["layers"][PARENT_LORA]))
        load_s = time.perf_counter() - t0

        # -- adapter + optimizer, created directly sharded ---------------------------------
        hp = spec.hyperparameters
        self.schedule = make_schedule(
            hp.lr_scheduler, base_lr=hp.learning_rate, total_steps=total_steps, warmup_steps=hp.warmup_steps
        )
        optimizer = make_optimizer(self.schedule, weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm)
        shardings = state_shardings(l_shard, optimizer, l_abstract, mesh)
        root_key = jax.random.key(spec.seed)
        lora = jax.jit(
            lambda k: init_lora(cfg, targets, spec.adapter.r, k, adapter_dtype), out_shardings=l_shard
        )(jax.random.fold_in(root_key, 0))
        self.state = init_state(lora, optimizer, shardings, jax.random.fold_in(root_key, 1))
        opt_report = sharding_report(self.state["opt_state"], shardings["opt_state"], mesh)

        # -- resume ----------------------------------------------------------------------
        self.progress = progress = Progress()
        self.metrics_log = (MetricsLog(self.output_dir, resume_step=resume_state.step if resume_state else None)
                            if primary else None)
        if resume_state is not None:
            self.state = ckpt.restore_state(resume_from, self.state, shardings)
            progress.step, progress.cursor = resume_state.step, resume_state.cursor
            progress.tokens_seen = int(resume_state.extra.get("tokens_seen", 0))
            progress.metrics = dict(resume_state.metrics)
            restore_host_rng(resume_state.rng)
            if int(self.state["step"]) != progress.step:
                raise UserError(f"checkpoint {resume_from} is inconsistent (step mismatch)",
                                code="incompatible_checkpoint")
            if primary:
                assert self.metrics_log is not None
                report_resumed(reporter, ckpt_root, resume_from, resume_state, self.metrics_log.rows(),
                               every_n_steps=spec.checkpoint.every_n_steps)

        # -- the step: compiled for the planned choice, stepped down if it does not fit --------
        limit = device_limit_bytes(spec, jax.local_devices()[0])
        planned = (spec.hyperparameters.micro_batch_size, spec.parallelism.remat)
        candidates = [planned]
        if limit is not None:
            candidates += fallback_steps(hp.batch_size // dp, *planned)
        tried: list[StepFit] = []
        for micro, remat in candidates:
            if (micro, remat) != planned:
                spec = self.spec = with_step(spec, micro, remat)
                _, accum = _data_parallel_plan(spec)
                if micro != planned[0]:
                    self.data = data = self._load_data(spec, tokenizer)
            sc = StepConfig(
                cfg=cfg,
                runtime=lora_runtime(spec.adapter.alpha, spec.adapter.r, spec.adapter.dropout),
                remat=spec.parallelism.remat,
                compute_dtype=spec.precision.compute_dtype,
                packed=spec.data.packing,
                # DPO: dp blocks of chosen-then-rejected rows per micro-batch (_step_batches)
                preference=PreferenceLoss(spec.method.beta, spec.method.sft_weight, blocks=dp) if dpo else None,
                reinforcement=reinforcement_loss(objective) if objective else None,
            )
            self.compiled_train_step, self.eval_step = compile_steps(sc, optimizer, mesh, shardings, p_shard)
            self.accum = accum
            first = (placeholder_batch(self.sampling.rows, accumulation=accum, row_len=self.row_len) if objective
                     else next(_step_batches(data.train, progress.cursor, dp, accum, self.pad_id))[0])
            compiled = self.compiled_train_step.compile(self.state, self.params, self._to_device(first))
            tried.append(StepFit(micro, remat, xla_step_bytes(compiled), limit))
            if tried[-1].fits:
                break
        else:
            raise OutOfMemory("no step fits one device: " + "; ".join(fit.describe() for fit in tried[:4])
                              + (f" (and {len(tried) - 4} more)" if len(tried) > 4 else ""))
        if primary:
            if len(tried) > 1:
                reporter.event(f"step stepped down: {tried[0].describe()} does not fit; running {tried[-1].describe()}",
                               level="warning", data={"step": {"micro_batch": micro, "remat": remat},
                                                      "tried": [vars(fit) for fit in tried]})
            else:
                reporter.event(f"step confirmed: {tried[-1].describe()}", data={"xla_bytes": tried[-1].xla_bytes,
                                                                                 "limit_bytes": limit})

        if primary:
            step = progress.step
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
                    **({"sampling": vars(self.sampling), "row_len": self.row_len} if objective else {}),
                },
            )
        if objective is not None:
            # The decode loop samples from the state's adapter on the params as they are sharded.
            # Its KV cache (rows x (prompt_len + new_tokens) slots per layer) is not part of
            # the step's memory check above: it exists only while sampling, between steps.
            decode = DecodeConfig(cfg=cfg, runtime=sc.runtime, shape=self.sampling,
                                  stop_ids=tuple(sorted(objective.stop_ids)), pad_id=objective.pad_id,
                                  compute_dtype=spec.precision.compute_dtype)
            self.sampler = Sampler(decode, mesh, p_shard, l_shard)
        else:
            self.batches = _step_batches(data.train, progress.cursor, dp, accum, self.pad_id)

    def _load_data(self, spec: TrainerSpec, tokenizer: Any) -> Any:
        """What the method trains on; for reinforcement also the fixed shapes of sampling
        (every prompt of both files fits them) and of the step's rows."""
        if self.objective is None:
            return load_training_data(spec, tokenizer, pad_to=spec.data.max_seq_len)
        from trainers.jax_lora.sampling import SamplingShape

        data = load_reinforcement_data(spec, tokenizer)
        prompts = data.train.dataset.prompts + (data.validation.dataset.prompts if data.validation else [])
        self.sampling = SamplingShape.for_prompts(spec.hyperparameters.batch_size * self.objective.samples_per_prompt,
                                                  prompts)
        # Each row (prompt + completion) holds at most max_seq_len tokens and this many.
        self.row_len = min(spec.data.max_seq_len, self.sampling.prompt_len + self.sampling.new_tokens)
        return data

    # -- the hooks of the common loop ------------------------------------------------------

    def _to_device(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        import jax

        from trainers.jax_lora.step import batch_sharding

        # Each process materializes only the slices its own devices hold.
        return {
            k: jax.make_array_from_callback(v.shape, batch_sharding(self.mesh, v.shape), lambda idx, v=v: v[idx])
            for k, v in host.items()
        }

    def train_step(self, step: int) -> StepResult:
        if self.objective is not None:
            return self._reinforcement_step(step)
        host_batch, next_cursor = next(self.batches)
        t_step = time.perf_counter()
        self.state, out = self.compiled_train_step(self.state, self.params, self._to_device(host_batch))
        loss = float(out["loss"])  # blocks: the step's time below is real
        elapsed = time.perf_counter() - t_step
        return StepResult(
            loss=loss, grad_norm=float(out["grad_norm"]), learning_rate=float(self.schedule(step)),
            tokens=int((host_batch["segment_ids"] > 0).sum()), elapsed_s=elapsed, cursor_after=next_cursor,
            rewards=_reward_sums({k: float(v) for k, v in out.items()}).metrics() if self.dpo else None,
        )

    def _reinforcement_step(self, step: int) -> StepResult:
        """Sample, grade, one GRPO update (``grpo.py``); the step's time includes the sampling."""
        from trainers.jax_lora.grpo import grpo_batch, sample_and_grade

        objective, spec = self.objective, self.spec
        assert objective is not None
        started = time.perf_counter()
        prompts, cursor_after = self.data.train.take(self.progress.cursor, spec.hyperparameters.batch_size)
        sampled = sample_and_grade(self.sampler, self.params, self.state["lora"], prompts, objective,
                                   objective.samples_per_prompt, seed=sampling_seed(spec.seed, step))
        host = grpo_batch(sampled, group_advantages(sampled.rewards, objective.samples_per_prompt),
                          accumulation=self.accum, row_len=self.row_len, pad_id=self.pad_id)
        self.state, out = self.compiled_train_step(self.state, self.params, self._to_device(host))
        out = {k: float(v) for k, v in out.items()}  # blocks: the step's time below is real
        return StepResult(
            loss=out["loss"], grad_norm=out["grad_norm"], learning_rate=float(self.schedule(step)),
            tokens=int((host["segment_ids"] > 0).sum()), elapsed_s=time.perf_counter() - started,
            cursor_after=cursor_after,
            rewards=step_metrics(sampled.rewards, sampled.lengths,  # type: ignore[arg-type]
                                 kl_sum=out["kl_sum"] if objective.kl_coef > 0 else None,
                                 clipped_tokens=out["clipped"], grading=sampled.grading),
            grading=sampled.grading,
        )

    def evaluate(self) -> dict[str, Any]:
        spec = self.spec
        if self.objective is not None:
            # valid_reward_mean: greedy answers with eval_samples 1, else that many sampled per prompt.
            from trainers.jax_lora.grpo import sample_and_grade

            n = self.objective.eval_samples
            sampled = sample_and_grade(self.sampler, self.params, self.state["lora"],
                                       self.data.validation.evaluation_prompts(spec.eval.max_batches), self.objective,
                                       n, seed=sampling_seed(spec.seed, self.progress.step, stream=1), greedy=n == 1)
            return evaluation_metrics(sampled.rewards)
        batches = _eval_batches(self.data.validation, self.dp, self.pad_id, spec.eval.max_batches)
        if self.dpo:
            sums, chosen_nll, chosen_tokens = RewardSums(), 0.0, 0.0
            for host in batches:
                out = {k: float(v) for k, v in self.eval_step(self.state["lora"], self.params,
                                                              self._to_device(host)).items()}
                sums = sums + _reward_sums(out)
                chosen_nll += out["chosen_nll"]
                chosen_tokens += out["chosen_tokens"]
            value = sums.loss / max(sums.pairs, 1.0) + spec.method.sft_weight * chosen_nll / max(chosen_tokens, 1.0)
            return {"valid_loss": value, "token_accuracy": None, **sums.metrics("valid_")}
        nll = n_tok = n_ok = 0.0
        for host in batches:
            out = self.eval_step(self.state["lora"], self.params, self._to_device(host))
            nll += float(out["nll_sum"])
            n_tok += float(out["n_tokens"])
            n_ok += float(out["n_correct"])
        return {"valid_loss": nll / max(n_tok, 1.0), "token_accuracy": n_ok / max(n_tok, 1.0)}

    def memory_bytes(self) -> int | None:
        import jax

        from trainers.common.memory import peak_rss_bytes

        return _device_memory_bytes(jax) or peak_rss_bytes()

    def _write_adapter(self, adapter_dir: Path, host_state: dict[str, np.ndarray]) -> None:
        """The trained LoRA of ``host_state`` (folded with a frozen parent's) as a finished
        PEFT adapter directory."""
        from trainers.jax_lora.export import to_peft_weights

        write_job_adapter(adapter_dir, to_peft_weights(_lora_from_flat(host_state)), self.spec, self.parent)

    def write_checkpoint(self, progress: Progress) -> Path | None:
        from trainers.jax_lora import checkpoint as ckpt

        host_state = ckpt.state_to_host(self.state)  # every process joins the gathers
        if not self.primary:
            return None
        spec = self.spec

        def write_tensors(d: Path) -> None:
            from safetensors.numpy import save_file

            save_file(host_state, str(d / ckpt.STATE_FILE))
            self._write_adapter(d / ADAPTER_DIR, host_state)

        ts = TrainerState(
            step=progress.step, epoch=epoch_of_step(progress.cursor), cursor=progress.cursor,
            rng=capture_host_rng(), metrics=progress.metrics,
            extra={"trainer": "jax_lora", "seed": spec.seed, "tokens_seen": progress.tokens_seen},
        )
        # Its metrics are spooled before the rename, its listing right after it.
        return save_checkpoint(self.ckpt_root, ts, write_tensors, keep_last=spec.checkpoint.keep_last,
                               reporter=self.reporter)

    def export_adapter(self, adapter_dir: Path) -> None:
        from trainers.jax_lora import checkpoint as ckpt

        host_state = ckpt.state_to_host(self.state)  # every process joins the gathers
        if self.primary:
            self._write_adapter(adapter_dir, host_state)

    def cleanup(self) -> None:
        """Nothing to release: the arrays go with the recipe."""


def run(
    spec: TrainerSpec,
    *,
    reporter: Reporter | None = None,
    stop: StopFlag | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train and export the adapter described by ``spec`` in this process (tests, benchmarks).

    Args:
        reporter: where reports go; None = a standalone reporter (``spec.report``), closed
            on return.
        stop: the stop flag; checked between steps (``trainers.common.recipe``).
        on_step: called with the step number after each optimizer step (tests use it to
            request a stop at a precise step).

    Raises:
        UserError, Preempted, OutOfMemory: see ``trainers.errors``.
    """
    return run_recipe(JaxLoraRecipe(on_step=on_step), spec, reporter=reporter, stop=stop)


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
