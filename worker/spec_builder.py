"""From a job row to the trainer spec: the one mapping between the API's job and a trainer.

The API's job schema maps to exactly one trainer spec, and this module is that map.
Every value a trainer uses is resolved here (no "auto" crosses into a spec): the
trainer family follows the pool, precision follows the accelerator (fp32 on CPU pools,
bf16 base + fp32 adapter on GPUs), the parallel layout follows the GPU count, and the
locations follow the artifact store (a local directory in the embedded default, S3 in
production). A JAX job on a local CPU pool runs as one XLA host device per core it may
use, with a ``data`` mesh over them (``parallelism.host_devices``), so that XLA's
single-threaded loop fusions run on every core (measured in bench/RESULTS.md, "jax_lora
as shipped on a CPU-only local pool").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, get_args

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.artifacts import artifact_store, file_store
from api.db.models import File, Job, ReportBatch
from api.models.base_models import load_base_models
from api.settings import Settings
from trainers.spec import (
    DEFAULT_TARGET_MODULES,
    AdapterSpec,
    CheckpointSpec,
    DataFormat,
    DataSpec,
    EvalSpec,
    HyperparametersSpec,
    IntegrationSpec,
    MeshSpec,
    MethodSpec,
    ModelSpec,
    ParallelismSpec,
    PrecisionSpec,
    ReportSpec,
    TrainerSpec,
)

# API spellings of the trainer -> the spec's recipe names.
TRAINER_NAMES = {"jax": "jax_lora", "jax_lora": "jax_lora", "fsdp_qlora": "fsdp_qlora"}


class SpecError(ValueError):
    """The job cannot be turned into a spec (its model or file disappeared)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def resolve_trainer(requested: str, pool_families: tuple[str, ...]) -> str:
    """The recipe for a job on a pool: the pool decides; "auto" takes its first family."""
    if requested in ("auto", "", None):
        return pool_families[0]
    name = TRAINER_NAMES.get(requested, requested)
    if name not in pool_families:
        raise SpecError(
            "trainer_not_available",
            f"trainer '{requested}' does not run on this pool (it runs {', '.join(pool_families)})",
        )
    return name


@cache
def precision_for(accelerator: str) -> PrecisionSpec:  # frozen, so one per accelerator
    if accelerator == "cpu":
        return PrecisionSpec(base_dtype="float32", compute_dtype="float32", adapter_dtype="float32")
    return PrecisionSpec(base_dtype="bfloat16", compute_dtype="bfloat16", adapter_dtype="float32")


# The threads a local trainer gets when the worker's environment names none.
LOCAL_TRAINER_THREADS = 2


def local_trainer_threads(environ: Mapping[str, str] = os.environ) -> int:
    """Threads per local trainer: the worker's ``OMP_NUM_THREADS``, else 2. The local
    executor gives its trainers this (worker/tasks/jobs.py); the spec builder sizes JAX's
    host devices by it."""
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


def _integrations(raw: list[dict[str, Any]] | None) -> tuple[IntegrationSpec, ...]:
    out = []
    for item in raw or []:
        kind = item.get("type")
        if kind == "wandb":
            cfg = item.get("wandb") or {}
            out.append(IntegrationSpec(type="wandb", project=cfg.get("project"), name=cfg.get("name"),
                                       entity=cfg.get("entity"), tags=tuple(cfg.get("tags") or ())))
        elif kind == "mlflow":
            cfg = item.get("mlflow") or {}
            out.append(IntegrationSpec(type="mlflow", tracking_uri=cfg.get("tracking_uri"),
                                       project=cfg.get("experiment"), name=cfg.get("run_name")))
    return tuple(out)


def _hyperparameters(hp: dict[str, Any], data_parallel: int) -> HyperparametersSpec:
    batch = int(hp["batch_size"])
    micro = int(hp.get("micro_batch_size") or 1)
    # Each data-parallel rank takes `micro` examples per forward; the global batch must
    # split evenly over ranks and micro-batches.
    while micro > 1 and batch % (micro * data_parallel):
        micro -= 1
    return HyperparametersSpec(
        n_epochs=int(hp["n_epochs"]),
        batch_size=batch,
        micro_batch_size=micro,
        learning_rate=float(hp["learning_rate"]),
        lr_scheduler=hp.get("lr_scheduler") or "cosine",
        warmup_steps=int(hp.get("warmup_steps") or 0),
        weight_decay=float(hp.get("weight_decay") or 0.0),
        max_grad_norm=hp.get("max_grad_norm", 1.0),
        max_steps=hp.get("max_steps"),
    )


def method_spec(method: Mapping[str, Any], hp: Mapping[str, Any]) -> MethodSpec:
    """The loss a job trains with: its ``method.type``, and for DPO the resolved ``beta``
    and ``sft_weight`` (stored with the job's other hyperparameters)."""
    if method.get("type", "supervised") != "dpo":
        return MethodSpec(type="supervised")
    return MethodSpec(type="dpo", beta=float(hp["beta"]), sft_weight=float(hp.get("sft_weight") or 0.0))


MAX_CHECKPOINT_INTERVAL = 500


def checkpoint_interval(hp: dict[str, Any]) -> int:
    """Steps between checkpoints: one per epoch, as OpenAI's jobs keep epoch checkpoints,
    but at least every MAX_CHECKPOINT_INTERVAL steps so a long epoch is never all lost
    (a SIGTERM — cancel, pause, preemption — checkpoints at once besides)."""
    total = int(hp.get("total_steps") or 1)
    per_epoch = max(1, math.ceil(total / max(1, int(hp.get("n_epochs") or 1))))
    return min(per_epoch, MAX_CHECKPOINT_INTERVAL)


def job_output_key(job_id: str) -> str:
    """Artifact-store key prefix of a job's outputs."""
    return f"{job_id}/output"


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

    Raises:
        SpecError: the model or a file no longer exists.
    """
    models = load_base_models(settings)
    if job.model not in models:
        raise SpecError("model_not_found", f"base model '{job.model}' is no longer configured")
    trainer = resolve_trainer(job.trainer, pool_families)

    files = file_store(settings)
    train = session.get(File, job.training_file)
    if train is None or train.deleted_at is not None:
        raise SpecError("file_not_found", f"training file {job.training_file} was deleted")
    fmt = (train.validation or {}).get("format")
    if fmt not in get_args(DataFormat):
        raise SpecError("invalid_file", f"training file {train.id} has no validated format")
    method = method_spec(job.method or {}, job.hyperparameters)
    if (method.type == "dpo") != (fmt == "preference"):
        raise SpecError("file_method_mismatch",
                        f"training file {train.id} ({fmt}) cannot train with method '{method.type}'")
    valid_location = None
    if job.validation_file:
        valid = session.get(File, job.validation_file)
        if valid is None or valid.deleted_at is not None:
            raise SpecError("file_not_found", f"validation file {job.validation_file} was deleted")
        valid_location = files.location(valid.location)

    store = artifact_store(settings)
    local_store = not store.location().startswith("s3://")
    job_dir = settings.job_dir(job.id)
    if in_cluster:
        checkpoint_dir = store.location(f"{job.id}/checkpoints")
        spool_dir, termination = f"/tmp/tunefleet-spool/{job.id}", "/dev/termination-log"
    else:
        checkpoint_dir = str(job_dir / "checkpoints") if local_store else store.location(f"{job.id}/checkpoints")
        spool_dir, termination = str(job_dir / "spool"), str(job_dir / "termination.json")

    host_devices = None
    if trainer == "jax_lora" and pool_accelerator == "cpu" and not in_cluster:
        host_devices = cpu_host_devices(local_trainer_cores(gpus), int(job.hyperparameters["batch_size"]))
    if trainer == "fsdp_qlora":
        data_parallel = gpus
    else:
        data_parallel = host_devices or 1
    adapter = dict(job.adapter or {})
    quantization = adapter.get("quantization") or ("nf4" if adapter.get("method") == "qlora" else "none")
    adapter_spec = AdapterSpec(
        method=adapter.get("method", "lora"),
        r=int(adapter.get("r", 8)),
        alpha=float(adapter.get("alpha", 16.0)),
        dropout=float(adapter.get("dropout", 0.0)),
        target_modules=tuple(adapter.get("target_modules") or DEFAULT_TARGET_MODULES),
        quantization=quantization if adapter.get("method") == "qlora" else "none",
        double_quant=bool(adapter.get("double_quant", False)),
        hqq_group_size=int(adapter.get("hqq_group_size", 64)),
        use_dora=bool(adapter.get("use_dora", False)),
    )
    parallelism = ParallelismSpec(
        world_size=gpus if trainer == "fsdp_qlora" else 1,
        mesh=(MeshSpec() if trainer != "jax_lora"
              else cpu_host_mesh(host_devices) if host_devices is not None
              else MeshSpec(data=1, fsdp=gpus, tensor=1)),
        host_devices=host_devices,
        activation_checkpointing="none" if pool_accelerator == "cpu" else "non_reentrant",
        remat="none" if pool_accelerator == "cpu" else "per_layer",
        cpu_offload=cpu_offload and trainer == "fsdp_qlora" and pool_accelerator != "cpu",
    )
    return TrainerSpec(
        job_id=job.id,
        trainer=trainer,  # type: ignore[arg-type]
        model=ModelSpec(path=models[job.model].path, architecture=models[job.model].architecture,
                        name=models[job.model].public_id, revision=models[job.model].revision),
        data=DataSpec(
            train_file=files.location(train.location),
            validation_file=valid_location,
            format=fmt,
            max_seq_len=job.max_seq_len,
            packing=job.packing,
        ),
        hyperparameters=_hyperparameters(job.hyperparameters, data_parallel),
        adapter=adapter_spec,
        method=method,
        parallelism=parallelism,
        precision=precision_for(pool_accelerator),
        eval=EvalSpec(**{k: v for k, v in (job.eval or {}).items() if k in ("every_n_steps", "max_batches")}),
        output_dir=store.location(job_output_key(job.id)),
        checkpoint=CheckpointSpec(dir=checkpoint_dir, resume_from="latest",
                                  every_n_steps=checkpoint_interval(job.hyperparameters)),
        report=ReportSpec(
            url=f"{settings.public_url}/internal/v1/jobs/{job.id}/reports",
            token=token,
            spool_dir=spool_dir,
            first_seq=_next_report_seq(session, job.id),
        ),
        integrations=_integrations(job.integrations),
        seed=int(job.seed),
        suffix=job.suffix,
        termination_log=termination,
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
