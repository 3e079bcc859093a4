"""From a job row to the trainer spec: the one mapping between the API's job and a trainer.

The API's job schema maps to exactly one trainer spec, and this module is that map.
Every value a trainer uses is resolved here (no "auto" crosses into a spec): the
trainer family follows the pool, precision follows the accelerator (fp32 on CPU pools,
bf16 base + fp32 adapter on GPUs), the parallel layout follows the GPU count, and the
locations follow the artifact store (a local directory in the embedded default, S3 in
production). A JAX job on a local CPU pool runs as one XLA host device per core it may
use, with a ``data`` mesh over them (``parallelism.host_devices``), so that XLA's
single-threaded loop fusions run on every core (measured in bench/RESULTS.md, "jax_lora
as shipped on a CPU-only local pool"). A job that continues a fine-tuned model gets that
model's stored adapter (``control.jobs.adapters``) as ``model.parent_adapters``: one
adapter, which already folds the parent's own lineage.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import get_args

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control.artifacts import ArtifactStore, artifact_store, file_store
from control.db.models import File, Job, ReportBatch
from control.job_settings import HyperparameterSettings, JobSettings, ParentSettings, TrainerChoice
from control.jobs.adapters import adapter_location
from control.models.base_models import load_base_models
from control.settings import Settings
from scheduling.estimator import ModelShape, TrainingShape
from scheduling.step_choice import StepChoice, choose_step, kept_step
from trainers.spec import (
    CheckpointSpec,
    DataFormat,
    DataSpec,
    HyperparametersSpec,
    MeshSpec,
    MethodSpec,
    ModelSpec,
    ParallelismSpec,
    ParentAdapterSpec,
    PrecisionSpec,
    ReportSpec,
    TrainerSpec,
    format_trains_method,
)


class SpecError(ValueError):
    """The job cannot be turned into a spec (its model or file disappeared)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def resolve_trainer(requested: TrainerChoice, pool_families: tuple[str, ...]) -> str:
    """The recipe for a job on a pool: the pool decides; "auto" takes its first family."""
    if requested == "auto":
        return pool_families[0]
    if requested not in pool_families:
        raise SpecError(
            "trainer_not_available",
            f"trainer '{requested}' does not run on this pool (it runs {', '.join(pool_families)})",
        )
    return requested


@cache
def precision_for(accelerator: str) -> PrecisionSpec:  # frozen, so one per accelerator
    if accelerator == "cpu":
        return PrecisionSpec(base_dtype="float32", compute_dtype="float32", adapter_dtype="float32")
    return PrecisionSpec(base_dtype="bfloat16", compute_dtype="bfloat16", adapter_dtype="float32")


# The threads a local trainer gets when the worker's environment names none.
LOCAL_TRAINER_THREADS = 2


def local_trainer_threads(environ: Mapping[str, str] = os.environ) -> int:
    """Threads per local trainer: the worker's ``OMP_NUM_THREADS``, else 2. The local
    executor gives its trainers this (``worker.executors.local.supervisor``); the spec
    builder sizes JAX's host devices by it."""
    return int(environ.get("OMP_NUM_THREADS") or LOCAL_TRAINER_THREADS)


def local_trainer_cores(slots: int, environ: Mapping[str, str] = os.environ,
                        available: int | None = None) -> int:
    """Cores a trainer on the local pool may use: its threads per slot, at most the host's.

    Args:
        slots: local-pool "GPUs" (concurrent trainer slots) the job holds.
        environ: the worker's environment (``OMP_NUM_THREADS``: threads per trainer).
        available: cores this process may run on (default: its CPU affinity).
    """
    threads = local_trainer_threads(environ)
    if available is None:
        available = len(os.sched_getaffinity(0))
    return max(1, min(threads * slots, available))


def cpu_host_devices(cores: int, batch_size: int) -> int:
    """XLA host devices for a JAX job on CPU: one per core, as many as divide the batch.

    Each device of the ``data`` mesh takes whole rows of every optimizer step, so the
    count must divide ``batch_size``; the largest such count up to ``cores`` wins.
    """
    return max(d for d in range(1, max(cores, 1) + 1) if batch_size % d == 0)


def cpu_host_mesh(host_devices: int) -> MeshSpec:
    """The mesh over a CPU host's XLA devices: data parallel (each core its own rows)."""
    return MeshSpec(data=host_devices, fsdp=1, tensor=1)


def data_parallel_for(trainer: str, accelerator: str, gpus: int, batch_size: int, *, in_cluster: bool) -> tuple[
        int, int | None]:
    """(data-parallel ranks, XLA host devices) of a job: fsdp_qlora one rank per GPU;
    jax_lora on a local CPU pool one rank per host device; otherwise one (the mesh shards
    the rows of a micro batch, not the batch)."""
    host_devices = None
    if trainer == "jax_lora" and accelerator == "cpu" and not in_cluster:
        host_devices = cpu_host_devices(local_trainer_cores(gpus), batch_size)
    return (gpus if trainer == "fsdp_qlora" else host_devices or 1), host_devices


def hyperparameters_spec(hp: HyperparameterSettings, data_parallel: int,
                         micro_batch: int | None = None) -> HyperparametersSpec:
    """The resolved hyperparameters, with the micro batch (the step choice's, else the
    job's) lowered until the global batch splits evenly over the data-parallel ranks and
    their micro-batches (each rank takes ``micro`` examples per forward)."""
    micro = micro_batch or hp.micro_batch_size
    while micro > 1 and hp.batch_size % (micro * data_parallel):
        micro -= 1
    return HyperparametersSpec(
        n_epochs=hp.n_epochs, batch_size=hp.batch_size, micro_batch_size=micro,
        learning_rate=hp.learning_rate, lr_scheduler=hp.lr_scheduler, warmup_steps=hp.warmup_steps,
        weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm, max_steps=hp.max_steps,
    )


MAX_CHECKPOINT_INTERVAL = 500


def checkpoint_interval(hp: HyperparameterSettings) -> int:
    """Steps between checkpoints: one per epoch, as OpenAI's jobs keep epoch checkpoints,
    but at least every MAX_CHECKPOINT_INTERVAL steps so a long epoch is never all lost
    (a SIGTERM — cancel, pause, preemption — checkpoints at once besides)."""
    per_epoch = max(1, math.ceil(hp.total_steps / hp.n_epochs))
    return min(per_epoch, MAX_CHECKPOINT_INTERVAL)


def job_output_key(job_id: str) -> str:
    """Artifact-store key prefix of a job's outputs."""
    return f"{job_id}/output"


def job_step(job: Job, *, model: ModelShape, training: TrainingShape, pool_accelerator: str,
             device_bytes: int, trainer: str, gpus: int, in_cluster: bool = False,
             offload_allowed: bool = False) -> StepChoice | None:
    """The step a placed job runs (``scheduling.step_choice``): a resumed job keeps the
    choice its first run stored (``job.estimate["step"]``), re-planned on its new gang,
    as long as the new device can run it; otherwise the fastest that fits. None for a
    job whose hyperparameters are not resolved (``build_spec`` refuses it)."""
    settings = JobSettings.from_row(job)
    if not settings.resolved:
        return None
    batch = settings.hyperparameters.batch_size
    data_parallel, host_devices = data_parallel_for(trainer, pool_accelerator, gpus, batch, in_cluster=in_cluster)
    # A CPU host mesh runs all its devices' rows in one process.
    per_process = host_devices or 1
    if job.resume_from:
        kept = kept_step((job.estimate or {}).get("step"), model, training, accelerator=pool_accelerator,
                         device_bytes=device_bytes, gpus=gpus, trainer=trainer, devices_per_process=per_process)
        if kept is not None:
            return kept
    return choose_step(model, training, accelerator=pool_accelerator, device_bytes=device_bytes, gpus=gpus,
                       trainer=trainer, batch_size=batch, data_parallel=data_parallel,
                       offload_allowed=offload_allowed, devices_per_process=per_process)


def build_spec(
    session: Session,
    job: Job,
    settings: Settings,
    *,
    pool_accelerator: str,
    pool_families: tuple[str, ...],
    gpus: int,
    token: str,
    in_cluster: bool = False,
    cpu_offload: bool = False,
    step: StepChoice | None = None,
) -> TrainerSpec:
    """The trainer spec for ``job`` placed on ``gpus`` GPUs of a pool.

    Args:
        session: a DB session (reads the job's files).
        job: the job row.
        settings: service settings (locations, public URL).
        pool_accelerator: the pool's accelerator (``cpu`` selects fp32).
        pool_families: trainer families the pool runs, preferred first.
        gpus: GPUs (local: processes) the job gets.
        token: the job's fresh report token.
        in_cluster: the trainer runs in a Kubernetes pod (paths inside the pod).
        cpu_offload: the placement counted on offloading parameters to host memory.
        step: the micro batch, rematerialization and offload chosen for the placement
            (``job_step``) and its planned memory; None: the job's micro batch, and
            per-layer rematerialization on accelerators.

    Raises:
        SpecError: the model, the fine-tuned model it continues or a file no longer exists,
            or the job's hyperparameters are not resolved yet.
    """
    models = load_base_models(settings)
    if job.base_model not in models:
        raise SpecError("model_not_found", f"base model '{job.base_model}' is no longer configured")
    job_settings = JobSettings.from_row(job)
    if not job_settings.resolved:
        raise SpecError("hyperparameters_not_resolved",
                        f"job {job.id} has \"auto\" hyperparameters left (its training file is not validated)")
    trainer = resolve_trainer(job_settings.trainer, pool_families)
    method = job_settings.method.spec()
    data = _data_spec(session, job, job_settings, method, file_store(settings))
    store = artifact_store(settings)
    checkpoint_dir, spool_dir, termination = _run_locations(settings, store, job.id, in_cluster=in_cluster)
    hp = job_settings.hyperparameters
    data_parallel, host_devices = data_parallel_for(trainer, pool_accelerator, gpus, hp.batch_size,
                                                    in_cluster=in_cluster)
    model = models[job.base_model]
    parents = (_parent_adapter(session, settings, job_settings.parent),) if job_settings.parent is not None else ()
    return TrainerSpec(
        job_id=job.id,
        trainer=trainer,  # type: ignore[arg-type]
        model=ModelSpec(path=model.path, architecture=model.architecture, name=model.public_id,
                        revision=model.revision, parent_adapters=parents),
        data=data,
        hyperparameters=hyperparameters_spec(hp, data_parallel, step.micro_batch if step else None),
        adapter=job_settings.adapter.spec(),
        method=method,
        parallelism=_parallelism(trainer, pool_accelerator, gpus, host_devices, cpu_offload=cpu_offload,
                                 step=step),
        precision=precision_for(pool_accelerator),
        eval=job_settings.eval.spec(),
        output_dir=store.location(job_output_key(job.id)),
        checkpoint=CheckpointSpec(dir=checkpoint_dir, resume_from="latest", every_n_steps=checkpoint_interval(hp)),
        report=ReportSpec(
            url=f"{settings.public_url}/internal/v1/jobs/{job.id}/reports",
            token=token,
            spool_dir=spool_dir,
            first_seq=_next_report_seq(session, job.id),
        ),
        integrations=tuple(integration.spec() for integration in job_settings.integrations),
        seed=job_settings.seed,
        suffix=job.suffix,
        termination_log=termination,
    )


def _parent_adapter(session: Session, settings: Settings, parent: ParentSettings) -> ParentAdapterSpec:
    """The stored adapter of the fine-tuned model a job continues (its final adapter, or its
    checkpoint's at ``parent.step``)."""
    parent_job = session.get(Job, parent.job_id)
    location = adapter_location(session, settings, parent_job, parent.step) if parent_job is not None else None
    if location is None:
        raise SpecError("parent_model_not_found",
                        f"the fine-tuned model '{parent.model}' this job continues is no longer stored")
    return ParentAdapterSpec(path=location, name=parent.model)


def _data_spec(session: Session, job: Job, job_settings: JobSettings, method: MethodSpec,
               files: ArtifactStore) -> DataSpec:
    """The job's files, checked: still there, validated, in a format its method trains."""
    train = session.get(File, job.training_file)
    if train is None or train.deleted_at is not None:
        raise SpecError("file_not_found", f"training file {job.training_file} was deleted")
    fmt = (train.validation or {}).get("format")
    if fmt not in get_args(DataFormat):
        raise SpecError("invalid_file", f"training file {train.id} has no validated format")
    if not format_trains_method(fmt, method.type):
        raise SpecError("file_method_mismatch",
                        f"training file {train.id} ({fmt}) cannot train with method '{method.type}'")
    valid_location = None
    if job.validation_file:
        valid = session.get(File, job.validation_file)
        if valid is None or valid.deleted_at is not None:
            raise SpecError("file_not_found", f"validation file {job.validation_file} was deleted")
        valid_location = files.location(valid.location)
    return DataSpec(train_file=files.location(train.location), validation_file=valid_location, format=fmt,
                    max_seq_len=job_settings.max_seq_len, packing=job_settings.packing)


def _run_locations(settings: Settings, store: ArtifactStore, job_id: str, *,
                   in_cluster: bool) -> tuple[str, str, str]:
    """Where a run keeps its checkpoints, spools its reports and writes why it failed: in a
    pod, the pod's paths (checkpoints in the artifact store); locally, the job's directory
    (checkpoints too, unless the artifact store is S3)."""
    if in_cluster:
        return store.location(f"{job_id}/checkpoints"), f"/tmp/tunefleet-spool/{job_id}", "/dev/termination-log"
    job_dir = settings.job_dir(job_id)
    local_store = not store.location().startswith("s3://")
    checkpoint_dir = str(job_dir / "checkpoints") if local_store else store.location(f"{job_id}/checkpoints")
    return checkpoint_dir, str(job_dir / "spool"), str(job_dir / "termination.json")


def _parallelism(trainer: str, accelerator: str, gpus: int, host_devices: int | None, *,
                 cpu_offload: bool, step: StepChoice | None = None) -> ParallelismSpec:
    """The parallel layout: fsdp_qlora one process per GPU; jax_lora a mesh over the GPUs,
    or over a CPU host's XLA devices. Rematerialization and offload are the step choice's;
    without one, CPU pools skip activation checkpointing and accelerators checkpoint
    every layer."""
    if trainer != "jax_lora":
        mesh = MeshSpec()
    elif host_devices is not None:
        mesh = cpu_host_mesh(host_devices)
    else:
        mesh = MeshSpec(data=1, fsdp=gpus, tensor=1)
    offload_ok = trainer == "fsdp_qlora" and accelerator != "cpu"
    if step is not None:
        return ParallelismSpec(
            world_size=gpus if trainer == "fsdp_qlora" else 1, mesh=mesh, host_devices=host_devices,
            activation_checkpointing=step.activation_checkpointing, remat=step.remat,
            cpu_offload=step.cpu_offload and offload_ok, planned_memory_bytes=step.planned_bytes,
            device_memory_bytes=step.device_bytes or None,
        )
    return ParallelismSpec(
        world_size=gpus if trainer == "fsdp_qlora" else 1,
        mesh=mesh,
        host_devices=host_devices,
        activation_checkpointing="none" if accelerator == "cpu" else "non_reentrant",
        remat="none" if accelerator == "cpu" else "per_layer",
        cpu_offload=cpu_offload and offload_ok,
    )


def write_spec(spec: TrainerSpec, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    tmp.touch(mode=0o600)  # the spec holds the job's report token: owner-only from the first byte
    spec.dump(tmp)
    tmp.replace(path)
    return path


def _next_report_seq(session: Session, job_id: str) -> int:
    """One past the highest report seq the API applied for the job: a run that starts with
    an empty spool (a new pod of a requeued job) must not reuse a seq, which the API would
    drop as a duplicate (with every metric in it)."""
    last = session.scalar(select(func.max(ReportBatch.seq)).where(ReportBatch.job_id == job_id))
    return int(last or 0) + 1
