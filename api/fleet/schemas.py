"""Fleet schemas: node pools with their capacity, the placement estimate, usage.

``EstimateRequest`` is the job-creation body (``JobCreate``) with the training file
optional: the example count may come from the file, from ``n_examples``, or the planned
token count directly from ``total_tokens`` (what-if questions before uploading).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from api.jobs.schemas import JobCreate
from api.schemas.common import AcceptWholeFloats, ListPublic

FileId = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class EstimateRequest(JobCreate):
    """The job-creation body; ``training_file`` optional, plus ``n_examples``/``total_tokens``."""

    training_file: FileId | None = None  # type: ignore[assignment]
    n_examples: Annotated[int, Field(strict=True, ge=1, le=100_000_000), AcceptWholeFloats] | None = None
    total_tokens: Annotated[int, Field(strict=True, ge=1, le=10**15), AcceptWholeFloats] | None = None


class NodeView(BaseModel):
    name: str
    gpus_total: int
    gpus_used: int
    gpus_free: int


class NodePoolPublic(BaseModel):
    """One pool: its configuration and what the running jobs hold of it now."""

    model_config = ConfigDict(extra="allow")

    object: Literal["node_pool"] = "node_pool"
    name: str
    accelerator: str
    gpu_memory_bytes: int
    gpu_memory_gib: float
    gpus_per_node: int
    nodes: int
    gpus_total: int
    gpus_used: int
    gpus_free: int
    trainers: list[str]
    trainer_image: str | None
    price_per_gpu_hour: float
    peak_tflops: float
    max_nodes_per_job: int
    running_jobs: list[str] = Field(
        description="Ids of running jobs (the caller's tenant only; admins: all)."
    )
    queued_jobs: int = Field(description="Queued jobs (all tenants) waiting for this pool.")
    node_list: list[NodeView]
    capacity_source: Literal["config", "cluster"] = Field(
        description="Where node counts come from: the pools file, or the cluster's Nodes as "
        "the scheduler last observed them (Kubernetes mode; see docs/internals.md)."
    )
    observed_at: int | None = Field(
        None, description="When the scheduler observed the cluster (unix seconds); null for config."
    )


NodePoolsPublic = ListPublic[NodePoolPublic]


class MemoryBreakdownPublic(BaseModel):
    """Bytes per GPU by component; the six add up to ``memory_per_gpu_bytes``."""

    weights: int = Field(
        description="Base weights (sharded) plus the one layer FSDP gathers, and (jax_lora on "
        "an NF4 base) one layer's weights dequantized to the compute dtype."
    )
    lora: int
    grads: int
    optimizer: int
    activations: int = Field(
        description="Saved activations plus logits and their fp32 loss copies."
    )
    overhead: int = Field(description="Allocator slack, FSDP buffers, CUDA/ROCm context.")


class PoolEstimatePublic(BaseModel):
    pool: str
    accelerator: str
    fits: bool
    gpus: int
    nodes: int
    cpu_offload: bool
    trainer: str | None
    memory_per_gpu_bytes: int | None
    capacity_bytes: int = Field(description="Memory of one GPU of the pool.")
    usable_bytes: int = Field(description="The part of it the estimate may plan for (headroom).")
    gpu_memory_bytes: int
    breakdown: MemoryBreakdownPublic | None
    tokens_per_s: float
    eta_s: float | None
    cost: float | None
    gpus_free: int
    reasons: list[str]


class ChosenPublic(BaseModel):
    """Where the job goes: now (``fit``), after preempting lower-priority jobs of the same
    tenant, or (``no_fit``) the pool it waits for while the fleet is busy."""

    pool: str
    gpus: int
    mode: Literal["fit", "fit_after_preemption", "no_fit"]
    trainer: str | None
    fits: bool = True
    cpu_offload: bool
    memory_per_gpu_bytes: int | None
    tokens_per_s: float
    eta_s: float | None
    cost: float | None
    preempts: int = Field(description="How many running jobs would be preempted.")
    reasons: list[str]


class ModelShapePublic(BaseModel):
    id: str
    params: int
    shape_source: str


class UnfitReasonPublic(BaseModel):
    """Why one pool can never hold the job (its configuration, not what runs on it)."""

    pool: str | None
    code: str = Field(description="pool_pinned_missing, trainer_cannot_train, gpus_above_pool_limit, "
                      "memory_does_not_fit or no_pool.")
    message: str


class EstimatePublic(BaseModel):
    object: Literal["fine_tuning.estimate"] = "fine_tuning.estimate"
    model: ModelShapePublic
    total_tokens: int | None
    mode: Literal["fit", "fit_after_preemption", "no_fit"]
    reasons: list[str]
    pools: list[PoolEstimatePublic]
    chosen: ChosenPublic | None
    unfit: list[UnfitReasonPublic] = Field(
        default_factory=list,
        description="When no pool can hold the job even with every GPU free, each pool's reason "
        "(creating it answers 400 no_pool_fits unless placement.queue_if_unfit); empty otherwise.",
    )
    notes: list[str]


class PoolUsage(BaseModel):
    gpu_seconds: float
    cost: float


class TenantUsagePublic(BaseModel):
    tenant_id: str | None
    jobs: int
    gpu_seconds: float
    cost: float
    by_pool: dict[str, PoolUsage]


class UsagePublic(TenantUsagePublic):
    object: Literal["usage"] = "usage"
    start: float | None
    end: float | None
    tenants: list[TenantUsagePublic] | None = Field(
        default=None, description="Per tenant, when an admin asks for every tenant."
    )
