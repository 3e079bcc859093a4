"""Node pools: the kinds of machines jobs can be placed on, declared in YAML.

A pool is a set of identical nodes (same accelerator, GPU memory, GPUs per node) that
Kubernetes selects by ``node_selector`` labels; the pool fixes the trainer family
(AMD MI300X -> ``jax_lora``, consumer NVIDIA -> ``fsdp_qlora``) and its image. The
embedded default (no ``TUNEFLEET_NODE_POOLS_FILE``) is one ``local`` pool: this machine,
CPU, a configurable number of slots, running both trainer families.

YAML shape (see ``deploy/pools/*.yaml``)::

    pools:
      - name: mi300x
        accelerator: amd-mi300x
        gpu_memory_gib: 192
        gpus_per_node: 8
        resource_name: amd.com/gpu
        node_selector: {tunefleet.io/pool: mi300x}
        tolerations: [{key: amd.com/gpu, operator: Exists, effect: NoSchedule}]
        trainer: jax_lora
        trainer_image: ghcr.io/tunefleet/trainer-jax-rocm:0.1.0
        price_per_gpu_hour: 2.50
        max_nodes_per_job: 4
        peak_tflops: 1307
        trainer_resources: {cpu_per_gpu: 12, memory_gib_per_gpu: 96}

``trainer_resources`` sizes the CPU and host memory of a trainer pod by the GPUs it holds
(a 2-GPU pod of a pool with the defaults requests 8 CPUs and 32 GiB). Its memory limit
equals its request unless ``memory_limit_gib_per_gpu`` says more; there is no CPU limit
unless ``cpu_limit_per_gpu`` sets one (a limit throttles data loading and the collective
communication threads). Host memory includes the pod's ``/dev/shm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainers.spec import TrainerName

GIB = 1024**3

Accelerator = Annotated[str, Field(pattern=r"^(cpu|amd-[a-z0-9-]+|nvidia-[a-z0-9-]+)$")]


class PoolConfigError(ValueError):
    """The node pools file is invalid; ``code`` is stable, the message says where."""

    code = "invalid_node_pools"


class Toleration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class TrainerResources(BaseModel):
    """CPU and host memory of a trainer pod per GPU it holds (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_per_gpu: Annotated[float, Field(gt=0)] = 4.0
    memory_gib_per_gpu: Annotated[float, Field(gt=0)] = 16.0
    cpu_limit_per_gpu: Annotated[float, Field(gt=0)] | None = None
    memory_limit_gib_per_gpu: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> TrainerResources:
        if self.cpu_limit_per_gpu is not None and self.cpu_limit_per_gpu < self.cpu_per_gpu:
            raise ValueError("cpu_limit_per_gpu must be at least cpu_per_gpu")
        if self.memory_limit_gib_per_gpu is not None and self.memory_limit_gib_per_gpu < self.memory_gib_per_gpu:
            raise ValueError("memory_limit_gib_per_gpu must be at least memory_gib_per_gpu")
        return self


class NodePool(BaseModel):
    """One pool of identical nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")]
    accelerator: Accelerator
    gpu_memory_bytes: Annotated[int, Field(gt=0)]
    gpus_per_node: Annotated[int, Field(ge=1, le=64)]
    resource_name: str | None = Field(
        default=None, description="Extended resource (amd.com/gpu, nvidia.com/gpu); None for CPU."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    trainers: tuple[TrainerName, ...] = Field(description="Trainer families this pool runs.")
    trainer_image: str | None = None
    price_per_gpu_hour: Annotated[float, Field(ge=0)] = 0.0
    max_nodes_per_job: Annotated[int, Field(ge=1)] = 1
    peak_tflops: Annotated[float, Field(gt=0)] = Field(
        description="Dense bf16 TFLOP/s per GPU (the estimator's speed basis)."
    )
    nodes: Annotated[int, Field(ge=0)] = Field(
        default=1, description="Node count for local mode and simulations; Kubernetes counts real Nodes."
    )
    max_gpus_per_tenant: dict[str, int] = Field(
        default_factory=dict, description="Per-tenant GPU quota in this pool; '*' = any tenant."
    )
    trainer_resources: TrainerResources = Field(default_factory=TrainerResources)
    quota_borrowing: bool = Field(
        default=False,
        description="Tenants may exceed their quota with idle GPUs; such borrowed GPUs may be "
        "preempted by the quota owner's jobs.",
    )

    @model_validator(mode="before")
    @classmethod
    def _gib_and_trainer(cls, data: object) -> object:
        if isinstance(data, dict):
            data = dict(data)
            if "gpu_memory_gib" in data:
                if "gpu_memory_bytes" in data:
                    raise ValueError("give gpu_memory_gib or gpu_memory_bytes, not both")
                data["gpu_memory_bytes"] = int(float(data.pop("gpu_memory_gib")) * GIB)
            if "trainer" in data:
                if "trainers" in data:
                    raise ValueError("give trainer or trainers, not both")
                data["trainers"] = (data.pop("trainer"),)
        return data

    @model_validator(mode="after")
    def _gpu_resource(self) -> NodePool:
        if self.accelerator != "cpu" and not self.resource_name:
            raise ValueError(f"pool {self.name}: a GPU pool needs resource_name (e.g. nvidia.com/gpu)")
        if not self.trainers:
            raise ValueError(f"pool {self.name}: trainers must not be empty")
        return self

    @property
    def is_cpu(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_bytes / GIB

    def quota_for(self, tenant: str) -> int | None:
        """This tenant's GPU quota in the pool, or None when unlimited."""
        if tenant in self.max_gpus_per_tenant:
            return self.max_gpus_per_tenant[tenant]
        return self.max_gpus_per_tenant.get("*")

    def preferred_trainer(self) -> TrainerName:
        return self.trainers[0]


class PoolsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: list[NodePool]

    @model_validator(mode="after")
    def _unique(self) -> PoolsFile:
        names = [p.name for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate pool names: {', '.join(dupes)}")
        if not self.pools:
            raise ValueError("at least one pool is required")
        return self


def local_pool(slots: int = 1, memory_bytes: int = 16 * GIB) -> NodePool:
    """The embedded default: this machine as one CPU node with ``slots`` trainer slots.

    A "GPU" of the local pool is one concurrent trainer process; its memory is the host
    RAM a trainer may use (the estimator still refuses jobs that cannot fit).
    """
    return NodePool(
        name="local",
        accelerator="cpu",
        gpu_memory_bytes=memory_bytes,
        gpus_per_node=slots,
        trainers=("fsdp_qlora", "jax_lora"),
        peak_tflops=0.5,
        nodes=1,
    )


def parse_pools(text: str, *, source: str = "<string>") -> list[NodePool]:
    """Parse a pools YAML document; errors name the file and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise PoolConfigError(f"{source}: expected a mapping with a 'pools' list")
    try:
        return PoolsFile.model_validate(data).pools
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise PoolConfigError(f"{source}: {problems}") from exc


def load_pools(path: str | Path | None, *, local_slots: int = 1) -> list[NodePool]:
    """Pools from ``path`` (``TUNEFLEET_NODE_POOLS_FILE``), or the embedded ``local`` pool."""
    if path is None or str(path) == "":
        return [local_pool(local_slots)]
    p = Path(path)
    if not p.is_file():
        raise PoolConfigError(f"node pools file {p} does not exist")
    return parse_pools(p.read_text(encoding="utf-8"), source=str(p))
