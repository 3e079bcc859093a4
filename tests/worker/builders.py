"""Small builders for scheduler tests: ``make_job().qlora("70b").priority("high")``."""

from __future__ import annotations

import itertools
from dataclasses import replace

from scheduling.capacity import CapacitySnapshot, RunningJob
from scheduling.estimator import TrainingShape
from scheduling.model_shapes import KNOWN_MODELS
from scheduling.pools import GIB, NodePool
from scheduling.priorities import priority_value
from scheduling.request import JobRequest

_ids = itertools.count(1)

SIZES = {"7b": "llama-2-7b", "8b": "llama-3.1-8b", "70b": "llama-3.1-70b", "405b": "llama-3.1-405b"}


class JobBuilder:
    def __init__(self) -> None:
        n = next(_ids)
        self._job = JobRequest(
            job_id=f"ftjob-{n:05d}", tenant="org-a", model=KNOWN_MODELS["llama-2-7b"],
            training=TrainingShape(method="qlora", quantization="nf4", seq_len=2048),
            created_at=float(n), total_tokens=10_000_000,
        )

    def _t(self, **kw) -> JobBuilder:
        self._job = replace(self._job, training=replace(self._job.training, **kw))
        return self

    def qlora(self, size: str, quantization: str = "nf4") -> JobBuilder:
        self._job = replace(self._job, model=KNOWN_MODELS[SIZES[size]])
        return self._t(method="qlora", quantization=quantization)

    def double_quant(self) -> JobBuilder:
        return self._t(double_quant=True)

    def lora(self, size: str) -> JobBuilder:
        self._job = replace(self._job, model=KNOWN_MODELS[SIZES[size]])
        return self._t(method="lora", quantization="none")

    def seq(self, n: int) -> JobBuilder:
        return self._t(seq_len=n)

    def priority(self, p: str | int) -> JobBuilder:
        self._job = replace(self._job, priority=priority_value(p))
        return self

    def tenant(self, t: str) -> JobBuilder:
        self._job = replace(self._job, tenant=t)
        return self

    def created(self, t: float) -> JobBuilder:
        self._job = replace(self._job, created_at=t)
        return self

    def pool(self, p: str) -> JobBuilder:
        self._job = replace(self._job, pool=p)
        return self

    def gpus(self, n: int) -> JobBuilder:
        self._job = replace(self._job, gpus=n)
        return self

    def trainer(self, t: str) -> JobBuilder:
        self._job = replace(self._job, trainer=t)
        return self

    def tokens(self, n: int) -> JobBuilder:
        self._job = replace(self._job, total_tokens=n)
        return self

    def id(self, job_id: str) -> JobBuilder:
        self._job = replace(self._job, job_id=job_id)
        return self

    def build(self) -> JobRequest:
        return self._job


def make_job() -> JobBuilder:
    return JobBuilder()


def mi300x(nodes: int = 4, **kw) -> NodePool:
    return NodePool(name="mi300x", accelerator="amd-mi300x", gpu_memory_bytes=192 * GIB, gpus_per_node=8,
                    resource_name="amd.com/gpu", trainers=("jax_lora",),
                    trainer_image="ghcr.io/tunefleet/trainer-jax-rocm:0.1.0", price_per_gpu_hour=3.0,
                    max_nodes_per_job=4, peak_tflops=1307, nodes=nodes,
                    node_selector={"tunefleet.io/pool": "mi300x"},
                    tolerations=({"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"},), **kw)


def rtx4090(nodes: int = 32, **kw) -> NodePool:
    return NodePool(name="rtx4090", accelerator="nvidia-rtx-4090", gpu_memory_bytes=24 * GIB, gpus_per_node=2,
                    resource_name="nvidia.com/gpu", trainers=("fsdp_qlora",),
                    trainer_image="ghcr.io/tunefleet/trainer-torch-cuda:0.1.0", price_per_gpu_hour=0.4,
                    max_nodes_per_job=4, peak_tflops=165, nodes=nodes,
                    node_selector={"tunefleet.io/pool": "rtx4090"},
                    tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},), **kw)


def cluster(*pools: NodePool, running: list[RunningJob] = ()) -> CapacitySnapshot:
    return CapacitySnapshot.from_pools_and_running(list(pools), list(running))


def running(job_id: str, pool: str, nodes: list[tuple[str, int]], *, tenant: str = "org-a",
            priority: str | int = "normal", started_at: float = 0.0, **kw) -> RunningJob:
    return RunningJob(job_id=job_id, tenant=tenant, pool=pool, priority=priority_value(priority),
                      started_at=started_at, nodes=tuple(nodes), **kw)
